"""`python -m services.prefill --model DIR [--port N]`: a prefill worker (Prefill and Health)."""

from services.prefill.servicer import add_prefill_role
from services.worker.server import serve

if __name__ == "__main__":
    serve("prefill", add_prefill_role)
