"""`make run`: the whole system on this machine. Workers, a gateway and Envoy, each its own
process; prints how to call it; Ctrl-C stops everything it started.

Environment: PORT (8080), MODEL (demo/tandem-demo: any Hugging Face folder the engine supports,
served under the folder's name), WORKERS (1), HOST (127.0.0.1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from deploy.envoy.render import render, start_envoy  # noqa: E402
from deploy.processes import free_port, named_address, start_service, stop  # noqa: E402


def banner(host: str, port: int, model: str) -> str:
    url = f"http://{host}:{port}"
    return f"""
tandem is ready on {url}  (model: {model})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'from openai import OpenAI
  c = OpenAI(base_url="{url}/v1", api_key="none")
  r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content)'

  gRPC: tandem.v1.Inference at {host}:{port} (protos/tandem/v1/inference.proto)
  REST: POST {url}/tandem/v1/chat/completions (and :stream for server-sent events)

Ctrl-C stops everything.
"""


def main() -> int:
    host = os.environ.get("HOST") or "127.0.0.1"
    port = int(os.environ.get("PORT") or 8080)
    model_dir = os.path.abspath(os.environ.get("MODEL") or os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    num_workers = int(os.environ.get("WORKERS") or 1)
    if not os.path.isdir(model_dir):
        print(f"MODEL={model_dir} is not a directory", file=sys.stderr)
        return 2
    name = os.path.basename(os.path.normpath(model_dir))
    started: list[subprocess.Popen] = []
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        workers = []
        for i in range(num_workers):
            print(f"starting worker {i + 1}/{num_workers} on {name} ...", flush=True)
            proc, address = start_service("services.worker", "--model", model_dir, stderr=None)
            started.append(proc)
            workers.append(address)
        print("starting gateway ...", flush=True)
        gateway, gateway_address = start_service(
            "services.gateway", "--model", model_dir, "--workers", ",".join(workers), stderr=None)
        started.append(gateway)
        print(f"starting envoy on {host}:{port} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            admin_port = free_port()
            config = render(port, admin_port, gateway_address, named_address(gateway, "openai"), host=host)
            started.append(start_envoy(config, tmp, admin_port))
            print(banner(host, port, name), flush=True)
            while not stopping.wait(0.5):
                dead = next((p for p in started if p.poll() is not None), None)
                if dead is not None:
                    print(f"a process exited ({' '.join(map(str, dead.args[:4]))}); stopping", file=sys.stderr)
                    return 1
        return 0
    finally:
        for proc in reversed(started):
            stop(proc)


if __name__ == "__main__":
    sys.exit(main())
