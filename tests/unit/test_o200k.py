"""gpt-oss's o200k_harmony vocabulary from the bpe-openai package: the ranks tiktoken expects
(sha256), the special tokens at gpt-oss's ids, tiktoken's and openai-harmony's encodings agreeing,
and both loaded with the network cut (where a fetch would fail, as the control shows)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine import o200k
from tests.offline import cut_network

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = "Weather in Paris? <|start|>assistant<|channel|>final<|message|>Ça va 😀 42<|return|>"

# The child process: no socket may connect (Python's tiktoken), and openai-harmony's own HTTP
# client (Rust) finds its proxy on a closed port; a fresh cache, so nothing was fetched before.
GUARDED = """
import socket
def refuse(*args, **kwargs):
    raise OSError("network touched")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = refuse
"""


def _run_offline(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TIKTOKEN_", "DATA_GYM")) and "PROXY" not in k.upper()
    }
    dead = "http://127.0.0.1:9"
    env.update(
        TANDEM_CACHE_DIR=str(tmp_path / "tandem"),
        TIKTOKEN_CACHE_DIR=str(tmp_path / "tiktoken"),
        TIKTOKEN_RS_CACHE_DIR=str(tmp_path / "tiktoken-rs"),
        HTTPS_PROXY=dead,
        HTTP_PROXY=dead,
        ALL_PROXY=dead,
        https_proxy=dead,
        http_proxy=dead,
        PYTHONPATH=ROOT,  # the child imports engine from this checkout
    )
    script = GUARDED + code
    return subprocess.run(
        [*cut_network(), sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_packaged_ranks_are_o200k_base_and_make_o200k_harmony():
    path = os.path.join(o200k.vocabulary_dir(), o200k.FILE_NAME)
    assert o200k._sha256(path) == o200k.SHA256
    encoding = o200k.encoding()
    assert encoding.n_vocab == o200k.VOCAB_SIZE == 201088
    markup = ["<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>"]
    assert [encoding.encode(m, allowed_special="all") for m in markup + ["<|call|>"]] == [
        [200002],
        [200003],
        [200005],
        [200006],
        [200007],
        [200008],
        [200012],
    ]
    harmony = o200k.harmony_encoding()
    assert encoding.encode(TEXT, allowed_special="all") == harmony.encode(
        TEXT, allowed_special="all"
    )
    assert sorted(harmony.stop_tokens_for_assistant_actions()) == [200002, 200012]


def test_openai_harmony_and_tiktoken_load_it_with_the_network_cut(tmp_path):
    loaded = _run_offline(
        "from engine import o200k\n"
        "ids = o200k.harmony_encoding().encode('hi <|call|>', allowed_special='all')\n"
        "assert ids == o200k.encoding().encode('hi <|call|>', allowed_special='all'), ids\n"
        "print('loaded', ids)\n",
        tmp_path,
    )
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr
    # The control: openai-harmony left to itself would fetch the file, and cannot here.
    fetched = _run_offline(
        "from openai_harmony import HarmonyEncodingName, load_harmony_encoding\n"
        "load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)\n",
        tmp_path,
    )
    assert fetched.returncode != 0
    assert "download" in fetched.stderr or "network" in fetched.stderr, fetched.stderr


def test_a_gpt_oss_folder_without_tokenizer_files_reads_o200k_harmony(tmp_path):
    import json

    from engine.tokenizer import Tokenizer, has_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert has_tokenizer(str(tmp_path))
    tokenizer = Tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 201088
    assert tokenizer.eos_token_ids == (200002, 199999, 200012)
    ids = tokenizer.encode(TEXT)
    assert ids == o200k.harmony_encoding().encode(TEXT, allowed_special="all")
    assert tokenizer.decode(ids) == TEXT.replace("<|start|>", "").replace(
        "<|channel|>", ""
    ).replace("<|message|>", "").replace("<|return|>", "")
    assert tokenizer.token_to_id("<|call|>") == 200012
