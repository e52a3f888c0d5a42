"""Chorus Mask Bank Loader and Chorus Similarity Match."""

from __future__ import annotations

import os

from comfy_api.latest import io

from . import CATEGORY

BANK_FOLDER_KEY = "chorus_banks"
NEW_BANK = "(create new bank)"
MaskBankType = io.Custom("CHORUS_MASK_BANK")
MatchType = io.Custom("CHORUS_MATCH")
BLOCK_SIZES = (16, 32, 64, 128, 256)


def register_bank_folder() -> None:
    """Register ``models/chorus_banks`` with ComfyUI (extra_model_paths.yaml can add more)."""
    import folder_paths

    if BANK_FOLDER_KEY not in folder_paths.folder_names_and_paths:
        default = os.path.join(folder_paths.models_dir, BANK_FOLDER_KEY)
        folder_paths.folder_names_and_paths[BANK_FOLDER_KEY] = ([default], set())
    for path in _folder_roots():
        os.makedirs(path, exist_ok=True)


def _folder_roots() -> list[str]:
    """Registered ``chorus_banks`` folders; ``NAME=postgresql://...`` lines of
    extra_model_paths.yaml are registered by ComfyUI too, but are no folders."""
    import folder_paths

    from ..chorus_core.bank.bank_url import is_url_line

    return [p for p in folder_paths.get_folder_paths(BANK_FOLDER_KEY) if not is_url_line(p)]


def _yaml_paths() -> list[str]:
    """The extra_model_paths.yaml files this ComfyUI reads (its own and --extra-model-paths-config)."""
    import itertools

    import folder_paths

    paths = [os.path.join(folder_paths.base_path, "extra_model_paths.yaml")]
    try:
        from comfy.cli_args import args

        paths += list(itertools.chain(*(args.extra_model_paths_config or [])))
    except Exception:  # in-process use without ComfyUI's command line
        pass
    return paths


def postgres_banks() -> dict[str, str]:
    """Named PostgreSQL banks: name -> URL (from CHORUS_BANK_URLS or extra_model_paths.yaml).
    The URL may carry a password: it is opened, never shown or stored in a workflow."""
    from ..chorus_core.bank.bank_url import named_urls

    return named_urls(os.environ, _yaml_paths())


def existing_banks() -> list[str]:
    """Bank names: folders holding ``bank.sqlite`` across the registered paths, and named
    PostgreSQL banks."""
    names = set(postgres_banks())
    for root in _folder_roots():
        if os.path.isdir(root):
            # only names the Loader accepts: a folder it would refuse is not offered in the combo
            names.update(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "bank.sqlite"))
                         and _check_bank_name(n) is None)
    return sorted(names)


def bank_path(name: str) -> str:
    """Location of bank ``name``: its PostgreSQL URL when it is a named PostgreSQL bank (never
    show it: :func:`~chorus_core.bank.bank_url.redact`), its folder where it exists, else a
    folder under the first registered path."""
    problem = _check_bank_name(name)
    if problem:  # whatever validation let through (a linked name, a prompt ComfyUI did not check)
        raise ValueError(problem)
    postgres = postgres_banks()
    if name in postgres:
        return postgres[name]
    roots = _folder_roots()
    for root in roots:
        if os.path.isfile(os.path.join(root, name, "bank.sqlite")):
            return os.path.join(root, name)
    return os.path.join(roots[0], name)


def _bank_name(bank: str, new_bank_name: str) -> str:
    return new_bank_name.strip() if bank == NEW_BANK else bank


LOADER = "Chorus Mask Bank Loader"


def _name_max(root: str) -> int:
    """Longest file name the banks' filesystem allows, in bytes (255 on ext4, NTFS, APFS)."""
    try:
        return os.pathconf(root, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no such folder yet, or no pathconf (Windows)
        return 255


def _check_bank_name(name: str, label: str = "bank name") -> str | None:
    """What is wrong with ``name`` as a bank folder name; ``label`` says which input gave it."""
    if not name:
        return (f"{LOADER}: new_bank_name is empty. Enter the name of the bank to create (it is used when bank "
                f"is '{NEW_BANK}'), or pick an existing bank.")
    if "\0" in name:
        return f"{LOADER}: {label} {name!r} contains a NUL character, which no file system allows in a folder name."
    if name != os.path.basename(name) or name.startswith(".") or any(c in name for c in '\\/:*?"<>|'):
        return (f"{LOADER}: {label} {name!r} must be a plain folder name (no path separators, not starting "
                f"with a dot); banks live in models/{BANK_FOLDER_KEY}.")
    size, limit = len(os.fsencode(name)), _name_max(_first_bank_root())
    if size > limit:
        return f"{LOADER}: {label} is {size} bytes long; the file system allows at most {limit}. Use a shorter name."
    return None


def bank_problem(bank: str | None, new_bank_name: str | None, read_only: bool | None) -> str | None:
    """What keeps the Loader from opening the bank it was given; None when nothing does (or when
    a linked input leaves it unknown until the node runs). ComfyUI 0.3.64 does not check a V3
    combo's value, so ``bank`` may be any string an API prompt sends."""
    if bank is None or (bank == NEW_BANK and new_bank_name is None):
        return None
    name = _bank_name(bank, new_bank_name)
    existing = existing_banks()
    if bank != NEW_BANK and bank not in existing:
        return (f"{LOADER}: bank {bank!r} is not an existing bank (a folder of models/{BANK_FOLDER_KEY} holding "
                f"bank.sqlite, or a named PostgreSQL bank). Pick one from the list, or '{NEW_BANK}' and a "
                f"new_bank_name.")
    problem = _check_bank_name(name, "new_bank_name" if bank == NEW_BANK else "bank")
    if problem:
        return problem
    if read_only and name not in existing:
        return (f"{LOADER}: Bank {name!r} does not exist, so it cannot be opened read-only. Untick read_only to "
                f"create it, or pick an existing bank.")
    return None


def _first_bank_root() -> str:
    import folder_paths

    roots = _folder_roots()
    return roots[0] if roots else folder_paths.models_dir


class ChorusMaskBankLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusMaskBankLoader",
            display_name="Chorus Mask Bank Loader",
            category=CATEGORY,
            description="Opens (or creates) a Chorus mask bank in models/chorus_banks, or a named PostgreSQL bank "
                        "shared by several machines (CHORUS_BANK_URLS or extra_model_paths.yaml): the sparse "
                        "attention masks recorded from earlier generations, indexed by request signature.",
            inputs=[
                io.Combo.Input("bank", options=[NEW_BANK, *existing_banks()], tooltip="An existing bank, or create a new one named below."),
                io.String.Input("new_bank_name", default="wan21_i2v", tooltip="Name of the bank to create when 'bank' is '(create new bank)': a plain folder name, at most 255 bytes."),
                io.Boolean.Input("read_only", default=False, tooltip="Match against the bank but never add entries (shared or curated banks)."),
            ],
            outputs=[MaskBankType.Output(display_name="mask_bank")],
        )

    @classmethod
    def validate_inputs(cls, bank, new_bank_name, read_only):
        # The rule reads all three inputs (which name is used, and whether it must exist), so
        # ComfyUI lists a failure under each; the web extension shows it once.
        return bank_problem(bank, new_bank_name, read_only) or True

    @classmethod
    def fingerprint_inputs(cls, bank, new_bank_name, read_only):
        from ..chorus_core.bank import BankError
        from ..chorus_core.bank.bank_url import is_bank_url, redact
        from ..chorus_core.bank.open_banks import shared_bank
        from ..chorus_core.reuse.bank_writer import default_writer

        try:
            path = bank_path(_bank_name(bank, new_bank_name))
        except ValueError:
            return float("nan")  # execute() runs and reports the bad name
        if not is_bank_url(path) and not os.path.isfile(os.path.join(path, "bank.sqlite")):
            return f"{path}:new"
        try:
            opened = shared_bank(path, read_only=True, create=False)  # not a new connection per prompt
            # A recording still being written changes the key too, so Similarity Match runs
            # again and waits for a similar pending entry instead of reusing a stale miss.
            # redact: a PostgreSQL URL's password stays out of ComfyUI's cache keys.
            return f"{redact(path)}:{opened.content_token()}:{default_writer().state_token()}"
        except BankError:
            return float("nan")  # never equal to itself: execute() runs and reports the error

    @classmethod
    def execute(cls, bank, new_bank_name, read_only) -> io.NodeOutput:
        from ..chorus_core.bank import BankError
        from ..chorus_core.bank.open_banks import shared_bank

        problem = bank_problem(bank, new_bank_name, read_only)
        if problem:  # linked inputs are known only now
            raise ValueError(problem)
        path = bank_path(_bank_name(bank, new_bank_name))
        try:
            # The same object as the last run's while it is the same bank: its signature index
            # and caches outlive the cache key, which changes with every write.
            opened = shared_bank(path, read_only=read_only, create=not read_only)
        except BankError as exc:
            raise ValueError(f"Chorus Mask Bank Loader: {exc}") from exc
        if not read_only:  # recordings a stopped process left spooled (no-op once replayed)
            from .spool_lifecycle import replay_in_background

            replay_in_background(path)
        return io.NodeOutput(opened)


class ChorusSimilarityMatch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusSimilarityMatch",
            display_name="Chorus Similarity Match",
            category=CATEGORY,
            description="Finds the most similar earlier request in the mask bank (CLIP-vision image embedding, "
                        "text conditioning, start-frame layout). A hit lets the sampler reuse its sparse attention masks.",
            inputs=[
                MaskBankType.Input("mask_bank", tooltip="From Chorus Mask Bank Loader."),
                io.Model.Input("model", tooltip="Only masks recorded with this exact model (fingerprint) are candidates."),
                io.ClipVisionOutput.Input("clip_vision_output", optional=True,
                                          tooltip="From CLIP Vision Encode of the start image; leave it empty for "
                                                  "text-to-video (then text and the latent grid make the signature)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning from WanImageToVideo (its start-frame latent gives the layout)."),
                io.Latent.Input("latent", tooltip="The latent the sampler will denoise (gives the video grid)."),
                io.Latent.Input("start_latent", optional=True, tooltip="Start-frame latent, when positive carries none."),
                io.Float.Input("threshold", default=0.9, min=0.0, max=1.0, step=0.005, tooltip="Overall similarity needed for a hit."),
                io.Float.Input("clip_weight", default=0.5, min=0.0, max=1.0, step=0.05, tooltip="Weight of the image embedding."),
                io.Float.Input("text_weight", default=0.3, min=0.0, max=1.0, step=0.05, tooltip="Weight of the text conditioning."),
                io.Float.Input("layout_weight", default=0.2, min=0.0, max=1.0, step=0.05, tooltip="Weight of the start-frame layout."),
                # A combo, not an Int: a slider of steps of 16 offered 48, 80, ... that validation refuses.
                io.Combo.Input("block_size", options=list(BLOCK_SIZES), default=128,
                               tooltip="Tokens per mask block. 128 for the GPU kernel; smaller only for tiny test models."),
            ],
            outputs=[MatchType.Output(display_name="match"), io.String.Output(display_name="summary")],
        )

    @classmethod
    def validate_inputs(cls, block_size):
        # Only the input it checks (see input_checks). ComfyUI 0.3.64 does not check a V3 combo's
        # value, so an API prompt may still send any number here.
        if block_size is None:  # linked: known only when the node runs
            return True
        if _as_block_size(block_size) not in BLOCK_SIZES:
            return f"block_size must be a power of two from 16 to 256 ({', '.join(map(str, BLOCK_SIZES))}) for the GPU kernels; got {block_size}."
        return True

    @classmethod
    def execute(cls, mask_bank, model, positive, latent, threshold, clip_weight, text_weight,
                layout_weight, block_size, clip_vision_output=None, start_latent=None) -> io.NodeOutput:
        from ..chorus_core.reuse.reuse_match import build_match_request, match_request

        weights = {"clip": clip_weight, "text": text_weight, "layout": layout_weight}
        request = build_match_request(model, clip_vision_output, positive, latent, start_latent, threshold,
                                      weights, _as_block_size(block_size))
        match = match_request(mask_bank, request)
        return io.NodeOutput(match, match.summary())


def _as_block_size(value):
    """The block size as an int: API prompts written when it was an Int input may send "128"."""
    return int(value) if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() else value


NODES = [ChorusMaskBankLoader, ChorusSimilarityMatch]


def bank_roots() -> list[str]:
    return _folder_roots()
