"""`python -m services.decode --model DIR [--port N] [--kv-transport ucx|tcp]`: a decode worker
(Decode and Health; its Health and ready line give the KV address prefill workers push to)."""

from services.decode.servicer import add_decode_role
from services.worker.server import serve

if __name__ == "__main__":
    serve("decode", add_decode_role)
