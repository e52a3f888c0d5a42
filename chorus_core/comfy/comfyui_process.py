"""Run a headless ComfyUI server with this pack, and talk to it over its HTTP API.

Used by the demo, the end-to-end tests and the API-mode example. The server gets its own
base directory (models, custom_nodes, input, output, user), so a run never touches the
ComfyUI checkout it starts from; the pack is linked into ``custom_nodes``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .comfyui_locator import PACK_DIR, locate_comfyui

PACK_FOLDER_NAME = "chorus"


# Python that resets SIGINT to its default, then becomes ComfyUI (exec: the same pid). A server started
# from a background job (a CI runner, `cmd &`) inherits SIGINT ignored and would ignore Ctrl-C where a
# user's ComfyUI would not. A preexec_fn could do the same, but is not safe in a process with threads.
_WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_base_directory(base: Path, pack_dir: Path = PACK_DIR) -> Path:
    """Create a ComfyUI base directory with the pack linked into ``custom_nodes``."""
    base = Path(base)
    for sub in ("custom_nodes", "models/diffusion_models", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_FOLDER_NAME
    if not link.exists():
        link.symlink_to(Path(pack_dir).resolve(), target_is_directory=True)
    return base


class ComfyServer:
    """A ComfyUI ``main.py`` process on a free loopback port; always stopped by its PID.

    :param base_dir: base directory made by :func:`prepare_base_directory`.
    :param cpu: run with ``--cpu`` (tests and CI have no GPU).
    """

    def __init__(self, base_dir: Path, comfyui: Path | None = None, cpu: bool = True,
                 extra_args: tuple[str, ...] = (), env: dict | None = None):
        self.base_dir = Path(base_dir)
        self.comfyui = Path(comfyui or locate_comfyui())
        self.port = free_port()
        self.cpu = cpu
        self.extra_args = extra_args
        self.env = env or {}
        self.log_path = self.base_dir / "comfyui.log"
        self.process: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240) -> "ComfyServer":
        args = [sys.executable, "-c", _WITH_DEFAULT_SIGINT, str(self.comfyui / "main.py"), "--listen", "127.0.0.1",
                "--port", str(self.port), "--base-directory", str(self.base_dir),
                "--disable-auto-launch", *(["--cpu"] if self.cpu else []), *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "wb")
        # a new session so that stop() can end ComfyUI and anything it spawned
        self.process = subprocess.Popen(args, cwd=self.comfyui, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.process.returncode} during start-up:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer on {self.url} within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=15)

    def __enter__(self):
        return self.start() if self.process is None else self

    def __exit__(self, *exc):
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # --- HTTP API -------------------------------------------------------------------
    def get_json(self, route: str):
        with urllib.request.urlopen(self.url + route, timeout=30) as response:
            return json.loads(response.read())

    def post_json(self, route: str, payload: dict):
        request = urllib.request.Request(self.url + route, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            raise RuntimeError(f"POST {route} failed ({exc.code}): {describe_refusal(body)}") from exc

    def queue_prompt(self, prompt: dict) -> str:
        """Submit an API-format workflow; returns its prompt id."""
        return self.post_json("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]

    def run_prompt(self, prompt: dict, timeout: float = 600, on_event=None) -> dict:
        """Submit a workflow, follow its websocket events to the end, return its ``/history`` record.

        The websocket is opened before submitting, and the run counts as over only at
        ComfyUI's final ``executing`` message (node None), which follows every event the
        nodes sent, so ``on_event`` sees all of them.

        :param on_event: called with every websocket JSON message (progress, executed, ...).
        """
        import websocket  # websocket-client; imported here so the library works without it

        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=timeout)
        try:
            prompt_id = self.queue_prompt(prompt)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                message = _receive(ws, min(5.0, max(deadline - time.monotonic(), 0.1)))
                if message is None:
                    if self.process.poll() is not None:
                        raise RuntimeError(f"ComfyUI exited while running {prompt_id}:\n{self.log_tail()}")
                    continue
                if on_event is not None:
                    on_event(message)
                if _ends(message, prompt_id):
                    return self._history_record(prompt_id)
        finally:
            ws.close()
        raise TimeoutError(f"prompt did not finish within {timeout:.0f}s:\n{self.log_tail()}")

    def _history_record(self, prompt_id: str) -> dict:
        for _ in range(50):  # the record is written right after the final message
            history = self.get_json(f"/history/{prompt_id}")
            if prompt_id in history:
                return history[prompt_id]
            time.sleep(0.1)
        raise RuntimeError(f"prompt {prompt_id} finished but /history has no record of it")


def describe_refusal(body: str) -> str:
    """A refused prompt's errors for a person, each once: ComfyUI's answer repeats a rule's message
    on every input the rule reads, beside its own generic ``message`` fields. Any other body is
    returned as it came."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    if not isinstance(answer, dict):
        return body
    top = answer.get("error") or {}
    top = top if isinstance(top, dict) else {"message": str(top)}
    node_errors = answer.get("node_errors") if isinstance(answer.get("node_errors"), dict) else {}
    lines = [top.get("message", "ComfyUI refused the prompt")]
    if top.get("details"):
        lines[0] += f": {top['details']}"
    for node_id, entry in node_errors.items():
        for detail, inputs in _errors_by_detail(entry.get("errors", [])).items():
            on = f" (input {', '.join(inputs)})" if inputs else ""
            lines.append(f"  node {node_id} {entry.get('class_type', '')}{on}: {detail}")
    return "\n".join(lines)


def _errors_by_detail(errors: list) -> dict:
    """{detail: [input names]}, the detail without ComfyUI's "input - " prefix."""
    grouped: dict = {}
    for error in errors:
        name = (error.get("extra_info") or {}).get("input_name")
        detail = error.get("details") or error.get("message", "")
        if name and detail.startswith(f"{name} - "):
            detail = detail[len(name) + 3:]
        inputs = grouped.setdefault(detail or error.get("message", ""), [])
        if name:
            inputs.append(name)
    return grouped


def _ends(message: dict, prompt_id: str) -> bool:
    data = message.get("data", {})
    if data.get("prompt_id") != prompt_id:
        return False
    kind = message.get("type")
    return kind in ("execution_error", "execution_interrupted") or (kind == "executing" and data.get("node") is None)


def _receive(ws, timeout: float):
    """One JSON websocket message, or None on timeout or a binary (preview) frame."""
    import websocket

    ws.settimeout(timeout)
    try:
        frame = ws.recv()
    except websocket.WebSocketTimeoutException:
        return None
    return json.loads(frame) if isinstance(frame, str) else None
