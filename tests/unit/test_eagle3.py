"""The EAGLE-3 drafter: lossless against plain decoding (greedy and seeded sampling), every
block given back, the serving head drafting exactly what the trainer's unrolled head
predicts at each depth (so training-time test is the serving path), and clear errors for a
head that does not fit the target."""

from __future__ import annotations

import json

import pytest
import torch

import services  # noqa: F401
from demo.train_eagle3 import target_states
from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import create_drafter
from engine.speculative.eagle3 import Eagle3Drafter
from services.draft.servicer import DraftServicer
from services.worker.draft_client import RemoteDrafter
from tandem.v1 import draft_pb2
from tests.tiny_models import make_eagle3_head, publish_eagle3_head

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(3, 40)), [11, 12, 13] * 8, [17]]
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in range(4)]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint("llama")[1]


@pytest.fixture(scope="module")
def head_folder(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    make_eagle3_head(checkpoint, folder)
    return str(folder)


def engine_with(checkpoint, head_folder=None, k=4) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_bytes=4 << 20,
                                    speculative="eagle3" if head_folder else "off", draft_model=head_folder,
                                    num_speculative_tokens=k))
    engine.speculator.tuner.choose = lambda batch_size: k  # these tests verify drafts, not tune their length
    return engine


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_output_equals_plain_decoding_and_every_block_comes_back(checkpoint, head_folder, params):
    want = engine_with(checkpoint).generate(PROMPTS, params)
    engine = engine_with(checkpoint, head_folder)
    got = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    drafter = engine.speculator.drafter
    assert engine.speculator.num_drafted > 50
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter._requests
    assert engine.num_free_blocks == engine.num_blocks


def test_the_serving_head_drafts_what_the_trained_head_predicts_at_each_depth(checkpoint, tmp_path):
    """Depth j of training-time test, row F-1+j, is the (j+1)-th token drafted after position F-1."""
    head = make_eagle3_head(checkpoint, tmp_path, draft_vocab=200, seed=1)
    engine = engine_with(checkpoint, str(tmp_path), k=3)
    drafter = engine.speculator.drafter
    engine.add_request("s", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()  # the prompt: its features go to the drafter
    seq = engine.seqs["s"]
    served = []  # the serving head's logits at each draft position
    head_logits = drafter.head.logits
    drafter.head.logits = lambda out: (served.append(head_logits(out)), served[-1])[1]
    drafts = drafter.propose([seq], [3])[0].token_ids
    assert len(drafts) == 3
    sequence = seq.token_ids + drafts
    (aux, _), = target_states(engine, [sequence], drafter.aux_layers, torch.float32)
    with torch.no_grad():
        logits = head.unrolled(aux[:-1][None], torch.tensor(sequence[1:])[None], depth=3)
    last = seq.num_tokens - 2  # F - 1: the last position with a target feature before the drafts
    for j in range(3):
        assert torch.allclose(logits[j][0, last + j], served[j][0], atol=1e-4), f"depth {j}"
    assert [int(head.d2t[logits[j][0, last + j].argmax()]) for j in range(3)] == drafts


def test_a_head_for_another_target_is_refused_with_a_clear_error(checkpoint, head_folder, tmp_path):
    config = json.loads(open(f"{head_folder}/config.json").read())
    config["hidden_size"] += 8
    for name in ("model.safetensors",):
        (tmp_path / name).write_bytes(open(f"{head_folder}/{name}", "rb").read())
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = engine_with(checkpoint)
    with pytest.raises(CheckpointError, match="hidden size"):
        create_drafter("eagle3", engine, draft_model=str(tmp_path))
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head"):
        create_drafter("eagle3", engine, draft_model=checkpoint)


class InProcessStub:
    """The draft service's servicer behind RemoteDrafter's stub, without a network."""

    def __init__(self, servicer):
        self.servicer = servicer

    def Propose(self, request, timeout):
        return self.servicer._propose(draft_pb2.ProposeRequest.FromString(request.SerializeToString()))


def test_the_draft_service_drafts_from_the_features_the_worker_sends(checkpoint, head_folder):
    want = engine_with(checkpoint).generate(PROMPTS, GREEDY)
    service_engine = engine_with(checkpoint, head_folder)  # only its drafter is used: the service's
    servicer = DraftServicer(service_engine.speculator.drafter)
    remote = RemoteDrafter("127.0.0.1:1")
    remote.stub = InProcessStub(servicer)
    remote.propose([], [])  # as at start: learns the head's layers
    engine = engine_with(checkpoint)
    engine.speculator.drafter = remote
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert remote.aux_layers == servicer.aux_layers and engine.speculator.num_drafted > 50
    assert [req.offset for req in servicer.drafter._requests.values()] == [0] * len(PROMPTS)  # whole prompts
    remote.propose([], [])  # the ended requests ride along
    assert not servicer.drafter._requests and not remote._features
    remote.close()


def test_unseeded_sampled_requests_get_drafts_with_q_in_process_and_from_the_service(checkpoint, head_folder):
    unseeded = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    local = engine_with(checkpoint, head_folder)
    servicer = DraftServicer(engine_with(checkpoint, head_folder).speculator.drafter)
    remote = RemoteDrafter("127.0.0.1:1")
    remote.stub = InProcessStub(servicer)
    remote.propose([], [])
    served = engine_with(checkpoint)
    served.speculator.drafter = remote
    for engine in (local, served):
        drafter, drafts = engine.speculator.drafter, []
        propose = drafter.propose
        drafter.propose = lambda seqs, ks: (drafts.extend(propose(seqs, ks)), drafts[-len(seqs):])[1]
        results = engine.generate(PROMPTS, unseeded)
        assert all(len(r.token_ids) == 30 for r in results)
        drawn = [d for d in drafts if d.token_ids]
        assert drawn and all(d.q is not None for d in drawn)
        for d in drawn:
            assert torch.allclose(d.q.sum(-1), torch.ones(len(d.token_ids)), atol=1e-5)
            chosen = d.q_ids == torch.tensor(d.token_ids)[:, None]
            assert (d.q[chosen] > 0).all() and chosen.sum() == len(d.token_ids)  # each token: in its q
        assert engine.num_free_blocks == engine.num_blocks
    remote.close()


def test_requests_the_heads_pool_cannot_hold_decode_plainly_and_lose_nothing(checkpoint, head_folder):
    want = engine_with(checkpoint).generate(PROMPTS, GREEDY)
    engine = engine_with(checkpoint)
    engine.speculator.drafter = drafter = Eagle3Drafter(
        head_folder, engine.model_config, engine.model.embedding_table(), num_blocks=6, block_size=engine.config.block_size,
        max_model_len=engine.max_model_len, dtype=engine.dtype, device=engine.device)
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.speculator.num_drafted > 0
    assert drafter.blocks.num_free_blocks == 6 and not drafter._requests


@pytest.mark.parametrize("aux_layers_field", ["top", "eagle_config"])
def test_a_head_in_the_published_llama_layout_drafts_as_the_same_head_in_tandem_s(checkpoint, tmp_path,
                                                                                   aux_layers_field):
    """SpecForge's LlamaForCausalLMEagle3 (a reduced vocabulary with d2t offsets and t2d): the
    same weights draft the same tokens and verification stays lossless."""
    make_eagle3_head(checkpoint, tmp_path / "own", draft_vocab=200, seed=2)
    publish_eagle3_head(tmp_path / "own", tmp_path / "published", aux_layers_field)
    want = engine_with(checkpoint).generate(PROMPTS, GREEDY)
    drafted = {}
    for layout in ("own", "published"):
        engine = engine_with(checkpoint, str(tmp_path / layout), k=3)
        proposals = []
        propose = engine.speculator.drafter.propose
        engine.speculator.drafter.propose = lambda seqs, k: proposals.append(propose(seqs, k)) or proposals[-1]
        got = engine.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], layout
        assert engine.speculator.num_drafted > 0  # Health's draft_acceptance_rate: accepted over these
        drafted[layout] = [[d.token_ids for d in step] for step in proposals]
    assert drafted["published"] == drafted["own"]


def test_the_mla_head_layout_is_named_and_refused(checkpoint, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                                      "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="Eagle3DeepseekV2ForCausalLM .multi-head latent attention. is not "
                                              "supported yet"):
        create_drafter("eagle3", engine_with(checkpoint), draft_model=str(tmp_path))
