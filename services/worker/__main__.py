"""`python -m services.worker --model DIR [--port N]`: a colocated worker (prefill and decode
in one engine): the Worker API's Generate and Health. See services/worker/server.py."""

from services.worker.server import serve

if __name__ == "__main__":
    serve("both")
