"""What Chorus Sparse Wan Sampler and Chorus Sparse Attention share: the reuse inputs and the
web view's events (sent over ComfyUI's websocket)."""

from __future__ import annotations

from comfy_api.latest import io

from .bank_nodes import MatchType

STEP_EVENT, RUN_START_EVENT, REPORT_EVENT = "chorus.step", "chorus.run_start", "chorus.report"


def send_event(event: str, payload: dict) -> None:
    """A websocket event for the web view; silent when no server runs (in-process use)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_sync(event, payload, server.client_id)


class NodeEvents:
    """The web view's events of one reuse node's runs, sent under that node's id.

    :param send_report: also send the finished report as an event (Chorus Sparse Attention: the
        sampler that runs its model has none of our outputs; the Sparse Wan Sampler's report is
        its own UI output)
    """

    def __init__(self, node_id, max_density: float, send_report: bool = True):
        self.node_id, self.max_density, self.send_report = node_id, max_density, send_report

    def run_start(self, report) -> None:
        send_event(RUN_START_EVENT, run_start_payload(self.node_id, report, self.max_density))

    def step(self, payload: dict) -> None:
        send_event(STEP_EVENT, {"node": self.node_id, **payload})

    def finished(self, report) -> None:
        if self.send_report:
            send_event(REPORT_EVENT, {"node": self.node_id, "chorus_report": report.to_json()})


def parse_dense_layers(text: str) -> tuple[int, ...]:
    """The ``dense_layers`` input ('0, 39') as sorted unique block indices; ValueError naming it otherwise."""
    try:
        return tuple(sorted({int(part) for part in text.replace(" ", "").split(",") if part}))
    except ValueError:
        raise ValueError(f"dense_layers must be comma-separated block indices such as '0, 39', got {text!r}") from None


def run_start_payload(node_id, report, max_density: float) -> dict:
    """The web view's "chorus.run_start" event: what the match found (components: empty when the
    bank had no compatible entry), and the cap the view compares the layers' densities with."""
    return {"node": node_id, "mode": report.mode, "steps": report.steps, "mask_source": report.mask_source,
            "entry_id": report.entry_id, "similarity": report.similarity, "components": dict(report.components),
            "max_density": max_density}


def reuse_option_inputs() -> list:
    """The optional match and the reuse options of both nodes."""
    return [
        MatchType.Input("match", optional=True, tooltip="From Chorus Similarity Match. Without it every run is a miss and nothing is recorded."),
        io.Int.Input("dense_warmup_steps", default=1, min=0, max=10000, tooltip="First steps of a miss run dense attention (the web view's kept density leaves them out). A hit uses hit_warmup_steps instead."),
        io.String.Input("dense_layers", default="", tooltip="Comma-separated block indices that always run dense, e.g. '0, 39'."),
        io.Combo.Input("miss_mode", options=["online", "prior", "dense"], default="prior",
                       tooltip="On a miss: use the bank's population prior (blocks most often kept by compatible "
                               "entries, no prediction cost; online when the bank has none); or predict masks from "
                               "pooled q/k each step; or run dense."),
        io.Float.Input("top_p", default=0.9, min=0.5, max=1.0, step=0.01, tooltip="Attention mass each query block keeps (online prediction and recording)."),
        io.Float.Input("min_density", default=0.05, min=0.01, max=1.0, step=0.01, tooltip="Least share of key blocks kept per query block (0.01 to 1, not above max_density)."),
        io.Float.Input("max_density", default=0.5, min=0.01, max=1.0, step=0.01, tooltip="Most share of key blocks kept per query block (0.01 to 1, not below min_density)."),
        io.Boolean.Input("record_on_miss", default=True, tooltip="Add this run's masks to the bank after a successful miss."),
        io.String.Input("tag", default="", tooltip="Tag stored with a recorded entry, e.g. the effect template's name."),
        # Optional, last: workflows and API prompts saved before it existed keep working unchanged.
        io.Combo.Input("dense_attention", options=["auto", "comfyui"], default="auto", optional=True,
                       tooltip="What the self-attention left dense (warm-up steps, dense layers) runs on. auto: "
                               "FlashAttention-4's dense forward on Hopper/Blackwell datacenter GPUs when flash-attn-4 "
                               "is installed, else torch SDPA with cuDNN first on Hopper (torch 2.6+; as ComfyUI does "
                               "on Windows), else ComfyUI's attention; comfyui: always ComfyUI's attention (and "
                               "whatever backend you chose there). Speed only: results agree to bf16 rounding."),
        io.Int.Input("hit_warmup_steps", default=0, min=0, max=10000, optional=True,
                     tooltip="First steps of a hit run dense. 0: a hit runs sparse from the first step, since its "
                             "entry holds every step's masks (the biggest saving at 4-8 steps). Older runs kept "
                             "dense_warmup_steps on hits too: set it to that to get the same output."),
        io.Int.Input("dense_last_steps", default=1, min=0, max=10000, optional=True,
                     tooltip="Last steps of the denoising run dense (a sampler that stops short of the end, such "
                             "as Wan 2.2's high-noise expert, keeps none). 1: on a 4-step hit about 11 dB closer to "
                             "the dense output on the testbed, ahead of core's Model Sparse Attention in speed and "
                             "quality; 0: the fastest, one dense step in four less (docs/quality.md, Defaults)."),
        io.Combo.Input("attention_precision", options=["bf16", "fp8"], default="bf16", optional=True,
                       tooltip="What the block-sparse attention computes in. bf16: the model's 16-bit type. fp8: "
                               "int8 QK^T and fp8 PV on FP8 tensor cores (Ada, Hopper and newer), bf16 where they "
                               "are missing (the report's backend says why). bf16 until fp8 is measured at no "
                               "quality cost (docs/quality.md, Defaults)."),
    ]


def reuse_options(dense_warmup_steps, dense_layers, miss_mode, top_p, min_density, max_density, record_on_miss, tag,
                  dense_attention="auto", hit_warmup_steps=0, dense_last_steps=1, model_files=(),
                  attention_precision="bf16"):
    """ReuseOptions from the inputs of reuse_option_inputs()."""
    from ..chorus_core.reuse.reuse_run import ReuseOptions

    return ReuseOptions(dense_warmup_steps=dense_warmup_steps, dense_layers=parse_dense_layers(dense_layers),
                        miss_mode=miss_mode, top_p=top_p, min_density=min_density, max_density=max_density,
                        record_on_miss=record_on_miss, tags=(tag,) if tag.strip() else (),
                        dense_attention=dense_attention, hit_warmup_steps=hit_warmup_steps,
                        dense_last_steps=dense_last_steps, model_files=model_files,
                        attention_precision=attention_precision)


MODEL_FILE_INPUTS = {"unet_name": "diffusion_models", "ckpt_name": "checkpoints"}  # loader input -> folder
MAX_MODEL_HOPS = 64  # LoRA, ModelSampling, ... nodes between the loader and the reuse node


def model_source_files(hidden) -> tuple[str, ...]:
    """The file the reuse node's ``model`` was loaded from, following ``model`` links upstream
    through the prompt to a loader (UNETLoader, CheckpointLoaderSimple, ...); () when unknown.
    A recording spooled with it is dropped at replay if the file has been deleted meanwhile."""
    prompt = getattr(hidden, "prompt", None)
    node = prompt.get(str(getattr(hidden, "unique_id", None))) if isinstance(prompt, dict) else None
    for _ in range(MAX_MODEL_HOPS):
        link = node.get("inputs", {}).get("model") if isinstance(node, dict) else None
        if not (isinstance(link, list) and len(link) == 2):
            return ()
        node = prompt.get(str(link[0]))
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        for key, folder in MODEL_FILE_INPUTS.items():
            if isinstance(inputs.get(key), str):
                return _full_path(folder, inputs[key])
    return ()


def _full_path(folder: str, name: str) -> tuple[str, ...]:
    import folder_paths

    try:
        path = folder_paths.get_full_path(folder, name)
    except Exception:  # an unknown folder in another ComfyUI version: the recording keeps no file
        return ()
    return (path,) if path else ()
