"""Train an EAGLE-3 head (engine/speculative/eagle3.py) for a target checkpoint, on CPU, seeded.

    python demo/train_eagle3.py [--model demo/tandem-demo] [--out DIR] [--steps N] [--quick]

1. Self-distillation data: the target writes its own greedy reply, through tandem's engine, to
   each prompt. For a chat model with its own template (SmolLM2: `make draft-model
   MODEL=smollm2`), prompts from demo/chat_prompts.py (open chat, code, tool calls with the
   tools in the system prompt; never the benchmark's held-out ones) in that template; for the
   demo model, or a checkpoint without a tokenizer (which gets the demo tokenizer's ids, as
   bench/speculative.py does), the demo corpus (chat, tool calls, answers from tool results)
   in the demo's template, each cut before an assistant reply.
2. The target's states for each whole sequence, through tandem's engine (the numbers the
   head will see when serving): the inputs of its three aux layers and its argmax at every
   position, the label the head learns to guess.
3. A reduced draft vocabulary: the target's most frequent labels, mapped back by `d2t`.
4. Training with training-time test unrolling: depth 0 reads the target's features; depth j
   reads the head's own depth j-1 outputs, one position back, and attends to depth-0 keys up
   to j positions back plus its own chain of earlier depths, exactly as drafting j tokens
   ahead does. Losses are weighted 0.8^j. The label at every depth is the target's argmax.
   Every 50 steps the log prints top-1 by depth on the recent batches and on 5% of the
   sequences held out of training (what serving asks of the head: replies it never saw).

The head is saved as `config.json` + `model.safetensors` (default: beside the folder the target
is read from, its name + `-eagle3`: for a GGUF model, beside its companion folder in the cache,
where `make run SPECULATIVE=eagle3` finds it). Sizes: FULL for the demo model, CHAT for a
chat model (a 30-layer, 576-wide SmolLM2 trains in about half an hour on 2 cores), QUICK for
a smoke run. Seeded and deterministic (`torch.use_deterministic_algorithms`).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from demo import chat_prompts
from demo.corpus import conversations
from demo.template import make_renderer
from demo.train import override, seed_everything
from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.gguf.folder import head_folder, model_folder
from engine.layers.quantized import dense
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.speculative.eagle3 import HeadConfig, default_aux_layers
from engine.tokenizer import Tokenizer

SEED = 4321  # apart from the target's own corpus seed: prompts it did not train on
HELD_OUT = 0.05  # of the self-distilled sequences, never trained on
GENERATE_CHUNK = 128
HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "tandem-demo")
FULL = dict(
    prompts=3000, max_reply=64, draft_vocab=1024, steps=1000, batch=8, lr=3e-3, unroll=4, window=160
)
# A chat model (SmolLM2-135M: 30 layers, 576 wide, 49k vocabulary): replies as long as the
# benchmark's, a draft vocabulary that covers nearly all labels, a window of the reply and the
# turn before it.
CHAT = dict(
    prompts=1200, max_reply=80, draft_vocab=4096, steps=700, batch=8, lr=2e-3, unroll=4, window=128
)
QUICK = dict(
    prompts=40, max_reply=16, draft_vocab=256, steps=20, batch=4, lr=3e-3, unroll=3, window=64
)


def uses_chat_prompts(engine: LLMEngine, folder: str) -> bool:
    """A chat model of its own (a tokenizer with a chat template), not the demo model."""
    tokenizer = engine.tokenizer
    return (
        os.path.abspath(folder) != os.path.abspath(DEMO)
        and tokenizer is not None
        and bool(getattr(tokenizer, "templates", None))
    )


def chat_model_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """`n` training prompts from demo/chat_prompts.py in the model's own template."""
    out = []
    for messages in chat_prompts.training(n, SEED):
        ids = chat_prompts.render(engine.tokenizer, messages)
        if len(ids) < engine.max_model_len // 2:
            out.append(ids)
    return out


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """`n` prompts, each a demo conversation cut before one of its assistant turns."""
    tokenizer = engine.tokenizer or Tokenizer(DEMO)
    render = make_renderer()
    rng = random.Random(SEED)
    out = []
    for messages, tools in conversations(SEED, n):
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        cut = rng.choice(turns)
        text = render(messages[:cut], tools, add_generation_prompt=True)
        ids = tokenizer.encode(text)
        if len(ids) < engine.max_model_len // 2 and max(ids) < engine.model_config.vocab_size:
            out.append(ids)
    return out


@torch.inference_mode()
def target_states(
    engine: LLMEngine,
    seqs: list[list[int]],
    aux_layers: tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
    keep: int | None = None,
):
    """Per sequence, of its last `keep` positions (None: all): the aux layers' inputs
    [keep, 3 x hidden] (bf16 by default, to save memory) and the target's argmax after each
    position [keep]. The positions before those are read from the prefix cache where
    generating left them (a long system prompt is not run again)."""
    states = []
    blocks = engine.block_manager
    for i, token_ids in enumerate(seqs):
        seq = Sequence(f"states-{i}", token_ids, SamplingParams(max_tokens=1), seed=0)
        keep_seq = keep or len(token_ids)
        skip = (len(token_ids) - keep_seq) // blocks.block_size if keep else 0
        cached = blocks.match_prefix(seq)[: max(0, skip)]
        blocks.allocate(seq, len(token_ids) - len(cached) * blocks.block_size, cached)
        batch = ScheduledBatch()
        batch.add(seq, len(token_ids) - seq.num_computed_tokens)
        inputs = engine.runner.prepare(batch)
        logits = engine.runner.execute(inputs, all_logits=True, aux_layers=aux_layers)
        states.append((inputs.aux_hidden[-keep_seq:].to(dtype), logits[-keep_seq:].argmax(dim=-1)))
        blocks.free(seq)
    return states


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The engine's RoPE (engine/layers/rotary.py: halves rotated) for x [B, heads, T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Head(nn.Module):
    """The trainable twin of engine/speculative/eagle3.py's Eagle3Head (same weight names)."""

    def __init__(self, cfg: HeadConfig, embed_tokens: torch.Tensor):
        super().__init__()
        h, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.cfg = cfg
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)  # the target's, frozen
        self.fc = nn.Linear(h * len(cfg.aux_layers), h, bias=False)
        self.embed_norm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.qkv_proj = nn.Linear(2 * h, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.post_attention_norm = RMSNorm(h, eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def qkv(self, tokens: torch.Tensor, features: torch.Tensor, cos, sin):
        cfg = self.cfg
        b, t, _ = features.shape
        x = torch.cat(
            [self.embed_norm(F.embedding(tokens, self.embed_tokens)), self.hidden_norm(features)],
            -1,
        )
        qkv = self.qkv_proj(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        q = rotate(qkv[:, : cfg.num_heads], cos, sin)
        k = rotate(qkv[:, cfg.num_heads : cfg.num_heads + cfg.num_kv_heads], cos, sin)
        v = qkv[:, cfg.num_heads + cfg.num_kv_heads :]
        group = cfg.num_heads // cfg.num_kv_heads
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def finish(self, features: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        h = features + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up_proj(self.post_attention_norm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def unrolled(self, aux: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Logits [B, T, draft vocab] at depths 0..depth-1. Row i of depth j drafts j tokens
        ahead: its feature is depth j-1's output at row i-1 (depth 0: the target's), its keys are
        depth 0's at rows <= i-j and depth s's at row i-j+s for s = 1..j."""
        b, t, _ = aux.shape
        pos = torch.arange(t, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        cos, sin = freqs.cos()[None, None], freqs.sin()[None, None]
        scale = 1 / math.sqrt(self.cfg.head_dim)
        rows = torch.arange(t)
        features = self.fc(aux)
        keys, values, logits = [], [], []
        for j in range(depth):
            q, k, v = self.qkv(tokens, features, cos, sin)
            keys.append(k)
            values.append(v)
            # Depth 0's keys, causal and j rows back; then one key per earlier depth, on the diagonal.
            scores = [
                (q @ keys[0].transpose(-1, -2) * scale).masked_fill(
                    rows[None, :] > rows[:, None] - j, float("-inf")
                )
            ]
            diagonal = []
            for s in range(1, j + 1):
                shift = j - s  # depth s's key for row i sits at row i - shift
                k_s = F.pad(keys[s], (0, 0, shift, 0))[:, :, :t]
                v_s = F.pad(values[s], (0, 0, shift, 0))[:, :, :t]
                score = (q * k_s).sum(-1, keepdim=True) * scale
                scores.append(score.masked_fill((rows < shift)[:, None], float("-inf")))
                diagonal.append(v_s)
            probs = torch.cat(scores, dim=-1).softmax(-1)
            attn = probs[..., :t] @ values[0]
            for s, v_s in enumerate(diagonal):
                attn = attn + probs[..., t + s : t + s + 1] * v_s
            out = self.finish(features, attn)
            logits.append(self.lm_head(self.norm(out)))
            features = F.pad(out, (0, 0, 1, 0))[:, :t]  # row i's next feature: this depth's row i-1
        return logits


def padded(rows):
    """aux [B, T, 3H], next tokens [B, T], labels [B, T] (draft ids, -100 off) of `rows`."""
    t = max(a.shape[0] for a, _, _ in rows)
    aux = torch.zeros(len(rows), t, rows[0][0].shape[1])
    tokens = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    for row, (a, nxt, lab) in enumerate(rows):
        aux[row, : a.shape[0]] = a.float()
        tokens[row, : nxt.shape[0]] = nxt
        labels[row, : lab.shape[0]] = lab
    return aux, tokens, labels


def batches(data, batch: int, steps: int, rng: random.Random):
    """`steps` padded batches of `batch` rows, every row once before any twice."""
    order = []
    for _ in range(steps):
        if len(order) < batch:
            order += rng.sample(range(len(data)), len(data))
        picked, order = order[:batch], order[batch:]
        yield padded([data[i] for i in picked])


def depth_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth j's labels: rows without j earlier positions draft nothing that deep."""
    labels = labels.clone()
    labels[:, :depth] = -100
    return labels


def held_out_top1(head: Head, held: list, unroll: int, batch: int) -> list[float]:
    """The head's top-1 by depth on sequences it never trains on."""
    hits, counts = [0] * unroll, [0] * unroll
    with torch.no_grad():
        for first in range(0, len(held), batch):
            aux, tokens, labels = padded(held[first : first + batch])
            for j, logits in enumerate(head.unrolled(aux, tokens, unroll)):
                lab = depth_labels(labels, j)
                mask = lab != -100
                hits[j] += int((logits.argmax(-1)[mask] == lab[mask]).sum())
                counts[j] += int(mask.sum())
    return [h / max(c, 1) for h, c in zip(hits, counts)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEMO, help="the target checkpoint folder")
    parser.add_argument("--out", default=None, help="output folder (default: MODEL-eagle3)")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"training steps (default {FULL['steps']})"
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help=f"self-distillation prompts ({FULL['prompts']})"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    args = parser.parse_args()
    seed_everything(SEED, args.threads)
    t0 = time.perf_counter()
    folder = model_folder(args.model)  # a GGUF model or a model's name: the folder it reads
    out = args.out or head_folder(folder)
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=2 << 30, max_num_seqs=64))
    mc = engine.model_config
    chat = uses_chat_prompts(engine, folder)
    cfg = dict(QUICK if args.quick else CHAT if chat else FULL)
    override(cfg, args, ("steps", "prompts"))
    asked = (chat_model_prompts if chat else prompts)(engine, cfg["prompts"])
    aux_layers = default_aux_layers(mc.num_layers)
    w = cfg["window"]
    seqs, states = [], []
    # In chunks: each chunk's states are taken while its prompts are still in the prefix cache.
    for first in range(0, len(asked), GENERATE_CHUNK):
        chunk = asked[first : first + GENERATE_CHUNK]
        replies = engine.generate(chunk, SamplingParams(max_tokens=cfg["max_reply"], temperature=0))
        seqs += [p + r.token_ids for p, r in zip(chunk, replies)]
        states += target_states(engine, seqs[first:], aux_layers, keep=w + 1)
        print(
            f"  replies and states {len(seqs)}/{len(asked)} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    print(
        f"self-distillation: {len(seqs)} prompts, {sum(map(len, seqs)) - sum(map(len, asked))} "
        f"reply tokens ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    # The draft vocabulary: the labels the head trains on (the windows'), most frequent first.
    counts = torch.bincount(
        torch.cat([argmax[1:] for _, argmax in states]), minlength=mc.vocab_size
    )
    draft_vocab = min(cfg["draft_vocab"], int((counts > 0).sum()))
    d2t = counts.argsort(descending=True, stable=True)[:draft_vocab].sort().values
    t2d = torch.full((mc.vocab_size,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(draft_vocab)
    covered = float(counts[d2t].sum() / counts.sum())
    # Row i: the feature of position i, token i+1, and the target's guess after token i+1.
    # Cropped to the last `window` positions (the reply and the turn before it): attention
    # costs the square of the length, and RoPE is relative, so a shorter context trains the same
    # skills at a fraction of the time.
    data = [
        (aux[:-1][-w:], torch.tensor(s[1:][-w:]), t2d[argmax[1:]][-w:])
        for s, (aux, argmax) in zip(seqs, states)
    ]
    # Sequences held out of training, picked at random (the prompts come in kinds): their top-1
    # in the log says what the head does on replies it never saw, as serving asks of it.
    order = random.Random(SEED).sample(range(len(data)), len(data))
    held = [data[i] for i in order[: int(len(data) * HELD_OUT)]]
    data = [data[i] for i in order[len(held) :]]
    print(
        f"target states: {sum(len(a) for a, _ in states)} positions, aux layers {aux_layers}; draft vocabulary "
        f"{draft_vocab} of {mc.vocab_size} covers {covered:.1%} of the labels ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )

    head_cfg = HeadConfig(
        hidden_size=mc.hidden_size,
        target_vocab_size=mc.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layers=aux_layers,
        num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        intermediate_size=mc.intermediate_size,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,
    )
    target = engine.model
    head = Head(head_cfg, target.embedding_table().detach().float().clone())
    with torch.no_grad():  # start from the target's own output layer
        head.norm.weight.copy_(dense(target.norm).float())
        lm = (
            head.embed_tokens
            if mc.tie_word_embeddings
            else dense(Checkpoint(folder).weights["lm_head.weight"])
        )
        head.lm_head.weight.copy_(lm.float()[d2t])
    del engine, states
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    steps, warmup = cfg["steps"], max(1, cfg["steps"] // 20)
    rng = random.Random(SEED)
    recent: list[list[float]] = []
    for step, (aux, tokens, labels) in enumerate(batches(data, cfg["batch"], steps, rng)):
        lr = cfg["lr"] * min(
            (step + 1) / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        logits = head.unrolled(aux, tokens, cfg["unroll"])
        losses, accs = [], []
        for j, lg in enumerate(logits):
            lab = depth_labels(labels, j)
            losses.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1)))
            mask = lab != -100
            accs.append(float((lg.argmax(-1)[mask] == lab[mask]).float().mean()))
        loss = sum(0.8**j * depth_loss for j, depth_loss in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        recent = (recent + [accs])[-50:]
        if (step + 1) % 50 == 0 or step + 1 == steps:
            mean = [sum(a[j] for a in recent) / len(recent) for j in range(len(accs))]
            unseen = held_out_top1(head, held, cfg["unroll"], cfg["batch"]) if held else []
            print(
                f"step {step + 1}/{steps}  loss {loss.item():.3f}  top-1 by depth "
                f"{' '.join(f'{a:.2f}' for a in mean)}, held out ({len(held)}) "
                f"{' '.join(f'{a:.2f}' for a in unseen)}  ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    save(out, head, head_cfg, d2t)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"saved {out} ({size / 1e6:.1f} MB); total {time.perf_counter() - t0:.0f}s", flush=True)


def save(out: str, head: Head, cfg: HeadConfig, d2t: torch.Tensor) -> None:
    import json

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {name: p.detach().contiguous() for name, p in head.named_parameters()}
    tensors["d2t"] = d2t.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
