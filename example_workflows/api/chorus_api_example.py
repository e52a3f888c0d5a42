"""Submit a Chorus I2V workflow to a running ComfyUI in API mode, with your own image and prompt.

    python chorus_api_example.py --server http://127.0.0.1:8188 \
        --workflow chorus_wan21_i2v_480p_api.json --image photo.png --prompt "the cat blinks" --tag cat_blink

Uploads the image, sets it on the LoadImage node and the prompt on the positive
CLIPTextEncode, follows progress over the websocket (including Chorus's per-step
"chorus.step" events) and prints the Chorus report from /history. Needs only the
standard library and websocket-client (pip install websocket-client).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path


def http_json(server: str, route: str, payload: dict | None = None, raw: bytes | None = None, headers=None):
    data = json.dumps(payload).encode() if payload is not None else raw
    request = urllib.request.Request(server + route, data=data, headers=headers or {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


class ServerRefused(Exception):
    """The server answered with an error; the message is the server's own."""


def refusal_text(answer: dict) -> str:
    """ComfyUI's validation answer to POST /prompt, one line per problem, as its log shows it."""
    error = answer.get("error", {})
    lines = [f"{error.get('message', 'the prompt was refused')}{': ' + error['details'] if error.get('details') else ''}"]
    for node_id, node in sorted(answer.get("node_errors", {}).items()):
        for problem in node.get("errors", []):
            lines.append(f"  node {node_id} ({node.get('class_type')}): {problem.get('message')}: {problem.get('details')}")
    return "\n".join(lines)


def queue(server: str, workflow: dict, client_id: str) -> str:
    """POST /prompt; raises ServerRefused with the server's validation errors on a 400."""
    try:
        return http_json(server, "/prompt", {"prompt": workflow, "client_id": client_id})["prompt_id"]
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            raise ServerRefused("the server refused the workflow:\n" + refusal_text(json.loads(body))) from None
        except json.JSONDecodeError:
            raise ServerRefused(f"the server refused the workflow: HTTP {exc.code}: {body}") from None


def upload_image(server: str, image: Path) -> str:
    """POST /upload/image (multipart); returns the name to give LoadImage."""
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{image.name}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + image.read_bytes() + \
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"overwrite\"\r\n\r\ntrue\r\n--{boundary}--\r\n".encode()
    answer = http_json(server, "/upload/image", raw=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return f"{answer['subfolder']}/{answer['name']}" if answer.get("subfolder") else answer["name"]


def positive_text_node(workflow: dict) -> str | None:
    """The CLIPTextEncode wired to a sampler's or WanImageToVideo's 'positive' input."""
    for node in workflow.values():
        link = node["inputs"].get("positive")
        if isinstance(link, list) and workflow[str(link[0])]["class_type"] == "CLIPTextEncode":
            return str(link[0])
    return None


def customise(workflow: dict, image_name: str | None, prompt: str | None, tag: str | None) -> dict:
    for node in workflow.values():
        if image_name and node["class_type"] == "LoadImage":
            node["inputs"]["image"] = image_name
        if tag and node["class_type"] == "ChorusSparseWanSampler":
            node["inputs"]["tag"] = tag
    text_node = positive_text_node(workflow)
    if prompt and text_node:
        workflow[text_node]["inputs"]["text"] = prompt
    return workflow


def connect(server: str, client_id: str, timeout: float):
    """Open the progress websocket before queueing: a prompt that fails at once sends its error
    only to clients already listening."""
    try:
        import websocket
    except ImportError:
        raise ServerRefused("this script needs websocket-client to follow progress: pip install websocket-client") from None
    return websocket.create_connection(server.replace("http", "ws", 1) + f"/ws?clientId={client_id}", timeout=timeout)


def follow(ws, prompt_id: str) -> None:
    """Print progress until ComfyUI reports the prompt finished."""
    while True:
        frame = ws.recv()
        if not isinstance(frame, str):
            continue  # binary latent previews
        message = json.loads(frame)
        kind, data = message.get("type"), message.get("data", {})
        if kind == "chorus.step":
            shares = " ".join(f"{l['sparse_share']:.0%}" for l in data["layers"])
            print(f"  step {data['step']}/{data['steps']} {data['mode']} sparse share per layer: {shares}")
        elif kind == "execution_error" and data.get("prompt_id") == prompt_id:
            raise ServerRefused(f"the workflow failed on the server: node {data.get('node_id')} ({data.get('node_type')}) failed: "
                                f"{data.get('exception_message', 'execution error').strip()}")
        elif kind == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--workflow", required=True, type=Path, help="an API-format workflow (Save (API) in ComfyUI)")
    parser.add_argument("--image", type=Path, help="start image to upload")
    parser.add_argument("--prompt", help="positive prompt text")
    parser.add_argument("--tag", help="tag stored with a recorded bank entry (e.g. the effect template)")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)

    try:
        image_name = upload_image(args.server, args.image) if args.image else None
        workflow = customise(json.loads(args.workflow.read_text()), image_name, args.prompt, args.tag)
        client_id = uuid.uuid4().hex
        ws = connect(args.server, client_id, args.timeout)
        try:
            prompt_id = queue(args.server, workflow, client_id)
            print(f"queued {prompt_id}")
            follow(ws, prompt_id)
        finally:
            ws.close()
    except ServerRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except urllib.error.URLError as exc:
        print(f"error: cannot reach ComfyUI at {args.server} ({exc.reason}); is it running?", file=sys.stderr)
        return 2
    record = http_json(args.server, f"/history/{prompt_id}")[prompt_id]
    reports = [r for out in record["outputs"].values() for r in out.get("chorus_report", [])]
    print(json.dumps({"status": record["status"]["status_str"], "chorus": reports}, indent=2))
    return 0 if record["status"]["status_str"] == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
