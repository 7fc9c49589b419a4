"""The EAGLE-3 drafter: lossless against plain decoding (greedy and seeded sampling), every
block given back, the serving head drafting exactly what the trainer's unrolled head
predicts at each depth (so training-time test is the serving path), and clear errors for a
head that does not fit the target."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

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
SAMPLED = [
    SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
    for s in range(4)
]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint("llama")[1]


@pytest.fixture(scope="module")
def head_folder(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    make_eagle3_head(checkpoint, folder)
    return str(folder)


def engine_with(checkpoint, head_folder=None, k=4) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            dtype="float32",
            kv_cache_bytes=4 << 20,
            speculative="eagle3" if head_folder else "off",
            draft_model=head_folder,
            num_speculative_tokens=k,
        )
    )
    # these tests verify drafts, not tune their length
    engine.speculator.tuner.choose = lambda batch_size: k
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
    engine.add_request(
        "s", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    engine.step()  # the prompt: its features go to the drafter
    seq = engine.seqs["s"]
    served = []  # the serving head's logits at each draft position
    head_logits = drafter.head.logits
    drafter.head.logits = lambda out: (served.append(head_logits(out)), served[-1])[1]
    drafts = drafter.propose([seq], [3])[0].token_ids
    assert len(drafts) == 3
    sequence = seq.token_ids + drafts
    ((aux, _),) = target_states(engine, [sequence], drafter.aux_layers, torch.float32)
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
        return self.servicer._propose(
            draft_pb2.ProposeRequest.FromString(request.SerializeToString())
        )


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
    # whole prompts
    assert [req.offset for req in servicer.drafter._requests.values()] == [0] * len(PROMPTS)
    remote.propose([], [])  # the ended requests ride along
    assert not servicer.drafter._requests and not remote._features
    remote.close()


def test_unseeded_sampled_requests_get_drafts_with_q_in_process_and_from_the_service(
    checkpoint, head_folder
):
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
        drafter.propose = lambda seqs, ks: (drafts.extend(propose(seqs, ks)), drafts[-len(seqs) :])[
            1
        ]
        results = engine.generate(PROMPTS, unseeded)
        assert all(len(r.token_ids) == 30 for r in results)
        drawn = [d for d in drafts if d.token_ids]
        assert drawn and all(d.q is not None for d in drawn)
        for d in drawn:
            assert torch.allclose(d.q.sum(-1), torch.ones(len(d.token_ids)), atol=1e-5)
            chosen = d.q_ids == torch.tensor(d.token_ids)[:, None]
            # each token: in its q
            assert (d.q[chosen] > 0).all() and chosen.sum() == len(d.token_ids)
        assert engine.num_free_blocks == engine.num_blocks
    remote.close()


def test_requests_the_heads_pool_cannot_hold_decode_plainly_and_lose_nothing(
    checkpoint, head_folder
):
    want = engine_with(checkpoint).generate(PROMPTS, GREEDY)
    engine = engine_with(checkpoint)
    engine.speculator.drafter = drafter = Eagle3Drafter(
        head_folder,
        engine.model_config,
        engine.model.embedding_table(),
        num_blocks=6,
        block_size=engine.config.block_size,
        max_model_len=engine.max_model_len,
        dtype=engine.dtype,
        device=engine.device,
    )
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.speculator.num_drafted > 0
    assert drafter.blocks.num_free_blocks == 6 and not drafter._requests


@pytest.mark.parametrize("aux_layers_field", ["top", "eagle_config"])
def test_a_head_in_the_published_llama_layout_drafts_as_the_same_head_in_tandem_s(
    checkpoint, tmp_path, aux_layers_field
):
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
        engine.speculator.drafter.propose = lambda seqs, k: (
            proposals.append(propose(seqs, k)) or proposals[-1]
        )
        got = engine.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], layout
        # Health's draft_acceptance_rate: accepted over these
        assert engine.speculator.num_drafted > 0
        drafted[layout] = [[d.token_ids for d in step] for step in proposals]
    assert drafted["published"] == drafted["own"]


def publish_mla_eagle3_head(
    target: str, folder, options: dict, seed: int = 3, draft_vocab: int = 200
) -> dict:
    """A random EAGLE-3 head in the MLA layout Kimi K2.5's heads on the Hub are published in
    (Eagle3DeepseekV2ForCausalLM: k-l-lambda/Kimi-K2.5-Eagle3's config fields, model_type
    kimi_k2, the aux layers in eagle_config, a reduced vocabulary as d2t offsets with t2d;
    `options`: EAGLE-3.1's fc_norm / norm_output / norm_before_residual, as lightseekorg's MLA
    heads set them), for the MLA `target`. Returns its weights (float32)."""
    import os

    from safetensors.torch import save_file

    raw = json.loads(open(os.path.join(target, "config.json")).read())
    h, heads, inter = raw["hidden_size"], raw["num_attention_heads"], 96
    nope, rope, v, q_rank, kv_rank = (
        raw[k]
        for k in (
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "q_lora_rank",
            "kv_lora_rank",
        )
    )
    aux = [0, 1, 1]  # the target's 2 layers: vLLM's default ids need more
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    d2t = torch.randperm(raw["vocab_size"], generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[d2t] = True
    a = "midlayer.self_attn."
    w = {
        "fc.weight": rand(h, 3 * h),
        "norm.weight": norm(h),
        "lm_head.weight": rand(draft_vocab, h, scale=1.0),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.post_attention_layernorm.weight": norm(h),
        a + "q_a_proj.weight": rand(q_rank, 2 * h),
        a + "q_a_layernorm.weight": norm(q_rank),
        a + "q_b_proj.weight": rand(heads * (nope + rope), q_rank),
        a + "kv_a_proj_with_mqa.weight": rand(kv_rank + rope, 2 * h),
        a + "kv_a_layernorm.weight": norm(kv_rank),
        a + "kv_b_proj.weight": rand(heads * (nope + v), kv_rank),
        a + "o_proj.weight": rand(h, heads * v),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "d2t": d2t - torch.arange(draft_vocab),
        "t2d": t2d,
        **({f"fc_norm.{i}.weight": norm(h) for i in range(3)} if options.get("fc_norm") else {}),
    }
    os.makedirs(folder, exist_ok=True)
    save_file({k: t.contiguous() for k, t in w.items()}, os.path.join(folder, "model.safetensors"))
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "draft_vocab_size": draft_vocab,
        "dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "head_dim": nope + rope,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "max_position_embeddings": raw["max_position_embeddings"],
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": heads,
        "rms_norm_eps": raw["rms_norm_eps"],
        "rope_scaling": {
            "type": "yarn",
            **{
                k: raw["rope_parameters"][k]
                for k in (
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "mscale",
                    "mscale_all_dim",
                )
            },
        },
        "rope_theta": raw["rope_parameters"]["rope_theta"],
        "tie_word_embeddings": False,
        "vocab_size": raw["vocab_size"],
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "q_lora_rank": q_rank,
        "kv_lora_rank": kv_rank,
        "v_head_dim": v,
        **options,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {**w, "d2t": d2t}


def reference_mla_drafts(
    w: dict, config: dict, embed: torch.Tensor, aux: torch.Tensor, tokens: list[int], k: int
) -> list[int]:
    """What vLLM's Eagle3DeepseekV2ForCausalLM drafts, in transformers' own DeepSeek-V3 attention
    (on the 2 x hidden input, o_proj padded to its width) without a cache: the whole sequence
    run again for each draft, its output (or, norm_output, the output normed) fed back."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    h, eps = config["hidden_size"], config["rms_norm_eps"]
    rope = dict(config["rope_scaling"], rope_type="yarn", rope_theta=config["rope_theta"])
    del rope["type"]
    hf = DeepseekV3Config(
        **{
            k: config[k]
            for k in (
                "num_attention_heads",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "q_lora_rank",
                "kv_lora_rank",
                "rms_norm_eps",
                "max_position_embeddings",
            )
        },
        hidden_size=2 * h,
        num_key_value_heads=config["num_attention_heads"],
        rope_parameters=rope,
    )
    hf._attn_implementation = "eager"
    attention, rotary = DeepseekV3Attention(hf, 0).eval(), DeepseekV3RotaryEmbedding(hf)
    a = "midlayer.self_attn."
    with torch.no_grad():
        for name, param in attention.named_parameters():
            param.copy_(
                torch.cat([w[a + name], torch.zeros_like(w[a + name])])
                if name == "o_proj.weight"
                else w[a + name]
            )

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    if config.get("fc_norm"):
        aux = torch.cat(
            [rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(aux.chunk(3, dim=-1))], dim=-1
        )
    features, ids, drafts = aux @ w["fc.weight"].T, list(tokens[1:]), []

    def mlp(x):
        gate, up = x @ w["midlayer.mlp.gate_proj.weight"].T, x @ w["midlayer.mlp.up_proj.weight"].T
        return (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    for _ in range(k):
        n = len(ids)
        normed = rms(features, w["midlayer.hidden_norm.weight"])
        x = torch.cat([rms(embed[ids], w["midlayer.input_layernorm.weight"]), normed], dim=-1)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            o = attention(x, rotary(x, torch.arange(n)[None]), mask)[0][0, :, :h]
        hidden = (normed if config.get("norm_before_residual") else features) + o
        out = hidden + mlp(rms(hidden, w["midlayer.post_attention_layernorm.weight"]))
        last = out[-1:]
        draft = int(w["d2t"][(rms(last, w["norm.weight"]) @ w["lm_head.weight"].T).argmax()])
        drafts.append(draft)
        features = torch.cat(
            [features, rms(last, w["norm.weight"]) if config.get("norm_output") else last]
        )
        ids.append(draft)
    return drafts


@pytest.fixture(scope="module")
def mla_checkpoint(hf_checkpoint):
    return hf_checkpoint("deepseek_v3_yarn")[1]  # MLA with a q latent, interleaved yarn RoPE


MLA_OPTIONS = [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_residual": True}]


@pytest.mark.parametrize(
    "options", MLA_OPTIONS, ids=["kimi-k2.5", "eagle3.1", "norm-before-residual"]
)
def test_a_head_in_the_published_mla_layout_drafts_what_transformers_attention_computes(
    mla_checkpoint, tmp_path, options
):
    """NVIDIA's and lightseekorg's Kimi heads: multi-head latent attention over [embedding,
    feature], served absorbed from the head's latent cache, draft at every depth what the
    unabsorbed layer (transformers' DeepseekV3Attention) drafts from the same target states."""
    from engine.sequence import Sequence

    w = publish_mla_eagle3_head(mla_checkpoint, tmp_path / "head", options)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    engine = engine_with(mla_checkpoint)
    drafter = Eagle3Drafter(
        str(tmp_path / "head"),
        engine.model_config,
        engine.model.embedding_table(),
        num_blocks=16,
        block_size=engine.config.block_size,
        max_model_len=engine.max_model_len,
        dtype=engine.dtype,
        device=engine.device,
    )
    for n, prompt in enumerate(PROMPTS[:3]):
        [(aux, _)] = target_states(engine, [prompt], drafter.aux_layers, dtype=torch.float32)
        seq = Sequence(f"r{n}", prompt, GREEDY, seed=0)
        # every position but the last verified: it drafts from there
        drafter.add_features(seq, 0, aux[:-1])
        [draft] = drafter.propose([seq], [4])
        assert draft.token_ids == reference_mla_drafts(
            w, config, engine.model.embedding_table(), aux[:-1], prompt, 4
        )
        drafter.forget(seq.request_id)
    assert drafter.blocks.num_free_blocks == 16


def test_a_head_in_the_published_mla_layout_keeps_verification_lossless(mla_checkpoint, tmp_path):
    publish_mla_eagle3_head(
        mla_checkpoint, tmp_path / "head", {"fc_norm": True, "norm_output": True}
    )
    want = engine_with(mla_checkpoint).generate(PROMPTS, GREEDY)
    engine = engine_with(mla_checkpoint, str(tmp_path / "head"), k=3)
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.speculator.num_drafted > 0  # Health's draft_acceptance_rate: accepted over these
    assert engine.num_free_blocks == engine.num_blocks


def test_an_mla_head_missing_a_weight_is_named(mla_checkpoint, tmp_path):
    import os

    from safetensors.torch import load_file, save_file

    publish_mla_eagle3_head(mla_checkpoint, tmp_path, {})
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["midlayer.self_attn.kv_b_proj.weight"]
    os.remove(tmp_path / "model.safetensors")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        create_drafter("eagle3", engine_with(mla_checkpoint), draft_model=str(tmp_path))
