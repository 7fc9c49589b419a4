"""Train tandem's demo model: a small Llama on synthetic chat and tool-call text, on CPU, seeded.

    python demo/train.py [--out demo/tandem-demo] [--steps N] [--quick] [--draft]

Steps: generate conversations (demo/corpus.py), render them with the shipped chat template
(demo/template.py), train a byte-level BPE tokenizer on them, pack the token stream into fixed
length rows (loss on assistant tokens only), train LlamaForCausalLM in fp32 with AdamW and a
cosine schedule, and save a Hugging Face folder the engine loads. The demo model trains its own
tokenizer, whose spaces inside names are a token of their own (`NAME_SPACE`). `--quick` is a
smoke run of about a minute into a temporary folder, with its own small tokenizer. `--draft`
trains a small drafter for speculative decoding of demo/tandem-demo into demo/tandem-demo-draft:
the committed corpus, the target's tokenizer reused byte for byte (a drafter's token ids must be
the target's), a smaller model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import tempfile
import time

import torch

from demo.corpus import ACCENTS, Names, conversations, drills
from demo.span_rows import SpanPieces, span_accuracy, span_batch
from demo.template import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    TOOL_CALL_TOKENS,
    make_renderer,
    tokenizer_config,
)

SEED = 1234
# Copy rows with repeated tokens (copy_batch's `alphabet`): each row's x from 8 to 16 draws.
REPEAT_ALPHABET = 16
# Loss on assistant replies only. (Loss on every token, tried at the same budget, learned
# less: its answers ignored the question altogether.)
REPLY_ONLY = True
WORD_SPLIT = r"'(?:[sdmt]|ll|ve|re)|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+"
# `novel` (--novel): the share of weather and search requests about made-up names (demo/corpus.py),
# so the model copies the name from the prompt rather than recall one of its 40 cities. Alone it
# did not teach copying (demo/README.md, run 5); after the copy pre-training (`copy_stage1/2`),
# and with copy rows mixed into every step (`copy_mix`), it does (run 8).
# Names of several words, accented and people's (issue 27; runs 9-24 of demo/README.md): `names`,
# `novel_multi`, `copy_mix_pool`, `copy_stage3`, `copy_mix_repeat` and the extra rows `call_*`
# (`call_answer`: answers from a tool's result among them, run 24); where a copied name ends:
# `name_spaces` (run 21). `copy_stage4`, `copy_mix_span` (span rows, demo/span_rows.py) and
# `call_end_weight` are tried and off. FULL is the committed model's recipe.
# `vocab_size` and `name_spaces` only matter with `new_tokenizer`.
FULL = dict(
    num_conversations=16000,
    new_tokenizer=True,
    name_spaces=True,
    vocab_size=2048,
    seq_len=512,
    batch_size=4,
    steps=800,
    hidden=256,
    layers=4,
    heads=8,
    kv_heads=2,
    intermediate=768,
    lr=3e-3,
    novel=0.7,
    names="rich",
    novel_multi=0.6,
    known_first=0.5,
    copy_stage1=400,
    copy_stage2=1500,
    copy_lr=1e-3,
    copy_stop=0.95,
    copy_pool="letters",
    copy_mix=0.5,
    copy_mix_pool="names",
    copy_stage3=1500,
    copy_mix_repeat=0.5,
    copy_stage4=0,
    copy_mix_span=0.0,
    call_mix=16,
    call_answer=0.25,
    call_chat=0.3333,
    call_multi=0.5,
    call_tail=0.75,
    call_end_weight=1.0,
)
# The corpus of run 8 (no made-up names, no copy training), rows and lr of FULL; a fifth of the
# parameters and a quarter of the step time, so more steps (1.6 epochs) in about 6.5 minutes on
# 2 cores.
DRAFT = dict(
    FULL,
    new_tokenizer=False,
    steps=2500,
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=384,
    novel=0.0,
    names="plain",
    novel_multi=None,
    known_first=0.0,
    copy_stage1=0,
    copy_stage2=0,
    copy_stop=0.97,
    copy_mix=0.0,
    copy_stage3=0,
    copy_mix_repeat=0.0,
    copy_stage4=0,
    copy_mix_span=0.0,
    call_mix=0,
)
QUICK = dict(
    num_conversations=3000,
    new_tokenizer=True,
    name_spaces=False,
    vocab_size=1024,
    seq_len=256,
    batch_size=4,
    steps=40,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    lr=3e-3,
    novel=0.0,
    names="plain",
    novel_multi=None,
    copy_stage1=0,
    copy_stage2=0,
    copy_lr=1e-3,
    copy_stop=0.97,
    copy_pool="letters",
    copy_mix=0.0,
    copy_mix_pool="letters",
    call_mix=0,
    call_answer=0.0,
    call_chat=0.5,
    call_multi=0.5,
    call_tail=0.0,
)


# --name-spaces: a space inside a name, before a capital or a particle and a capital ("Hong Kong",
# "Dar es Salaam"), becomes NAME_SPACE, a token of its own (decoded back to a space). With spaces
# as tokens of their own, where a copied name ends is read two tokens ahead ("Hong", a space, then
# "Kong" or "today"); runs 9-19 of demo/README.md never learned that. With NAME_SPACE the copy's
# next token says it: NAME_SPACE goes on, a plain space or punctuation ends the name.
NAME_SPACE = "\u2581"
NAME_SPACE_AT = r" (?=\p{Lu}|(?:de|da|do|dos|das|del|di|du|des|es|el|la|le|van|von|der|bin) \p{Lu})"


def train_tokenizer(texts: list[str], vocab_size: int, name_spaces: bool = False):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if name_spaces:
        tok.normalizer = normalizers.Replace(Regex(NAME_SPACE_AT), NAME_SPACE)
    # GPT-2's split glues a leading space to a word, so "in Paris" and '"city": "Paris"' hold
    # different tokens for Paris and copying a city into a tool call is a lookup to learn.
    # Spaces stand alone here: a word is the same token wherever it appears.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(WORD_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if name_spaces:
        tok.decoder = decoders.Sequence([tok.decoder, decoders.Replace(NAME_SPACE, " ")])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Special and tool-call tokens are whole tokens: keep their text out of the merges.
    markers = SPECIAL_TOKENS + TOOL_CALL_TOKENS

    def plain(text: str) -> str:
        for m in markers:
            text = text.replace(m, "\n")
        return text

    tok.train_from_iterator((plain(t) for t in texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TOKENS])
    return tok


def load_target_tokenizer(target: str):
    """The committed tokenizer as is: a draft proposes token ids that the target then verifies, and
    the target keeps the ids the draft and other code were built with."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=True) == vocab, (
        "target's tokenizer and config disagree"
    )
    return tok


def pack(tok, texts: list[str], seq_len: int, whole: bool = False):
    """Rows of `seq_len` tokens and their labels (-100 outside assistant replies).

    A reply is everything after `<|assistant|>\\n` up to and including `<|end|>`: what the
    model writes when served.
    """
    assistant, end = tok.token_to_id("<|assistant|>"), tok.token_to_id(EOS)
    ids: list[int] = []
    labels: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        in_reply = False
        prev = None
        for t in enc.ids:
            ids.append(t)
            labels.append(t if in_reply or not REPLY_ONLY else -100)
            if t == end:
                in_reply = False
            if prev == assistant:
                in_reply = True  # the token after <|assistant|> is its newline, part of the prompt
            prev = t
    if whole:  # one text's ids and labels as lists, not cut into rows
        return ids, labels
    num_rows = len(ids) // seq_len
    ids_t = torch.tensor(ids[: num_rows * seq_len]).view(num_rows, seq_len)
    labels_t = torch.tensor(labels[: num_rows * seq_len]).view(num_rows, seq_len)
    return ids_t, labels_t


def corpus_conversations(cfg: dict) -> list:
    """The corpus' conversations (demo/corpus.py: conversations), seeded; made-up names drawn as
    `names` says (plain: the committed model's generator, rich: demo/corpus.py's Names)."""
    names = (
        None
        if cfg["names"] == "plain"
        else Names(multi=cfg.get("novel_multi"), known_first=cfg.get("known_first", 0.0))
    )
    return conversations(SEED, cfg["num_conversations"], cfg["novel"], names)


def drill_conversations(cfg: dict) -> list:
    """The extra rows' conversations (`call_mix` a step, demo/corpus.py: drills), seeded."""
    num = cfg.get("call_mix", 0) * cfg["steps"]
    names = Names(known_first=cfg.get("known_first", 0.0))
    return drills(
        SEED + 13,
        num,
        cfg["call_chat"],
        cfg["call_multi"],
        cfg["call_tail"],
        names,
        cfg["call_answer"],
    )


def call_rows(
    tok, convs: list, end_weight: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Short rows (`drill_conversations`: a request about a made-up name and the call that copies
    it, an answer from a tool's result, or a chat turn), right-padded to the longest; labels on
    the replies, as `pack`; and each label's loss weight: `end_weight` on the tokens after each
    word of a call's string arguments (`word_ends`), 1 elsewhere."""
    render = make_renderer()
    texts = [render(*conv) for conv in convs]
    rows = [pack(tok, [text], 1 << 20, whole=True) for text in texts]
    num, width = len(rows), max(len(ids) for ids, _ in rows)
    ids_t = torch.full((num, width), tok.token_to_id(PAD))
    labels_t = torch.full((num, width), -100)
    weights_t = torch.ones(num, width)
    for i, (ids, labels) in enumerate(rows):
        ids_t[i, : len(ids)], labels_t[i, : len(ids)] = (torch.tensor(ids), torch.tensor(labels))
        if end_weight != 1.0:
            weights_t[i, word_ends(tok, texts[i], convs[i][0])] = end_weight
    return ids_t, labels_t, weights_t


def word_ends(tok, text: str, messages: list[dict]) -> list[int]:
    """Positions of the tokens that follow each word of the string arguments of the last call in
    `text`: a space where the copy goes on, a closing quote where it stops. With spaces as tokens
    of their own this choice reads two tokens ahead in the prompt ("Hong" then a space then
    "Kong" or "today"), a rare token in a row that the models of runs 9-18 left to the name's
    look (demo/README.md)."""
    calls = messages[-1].get("tool_calls") or []
    if not calls:
        return []
    args = json.loads(calls[-1]["function"]["arguments"])
    enc = tok.encode(text, add_special_tokens=False)
    token_at = {start: i for i, (start, end) in enumerate(enc.offsets) if end > start}
    ends, base = [], text.rfind(TOOL_CALL_TOKENS[0])
    for value in (v for v in args.values() if isinstance(v, str)):
        quoted = json.dumps(value, ensure_ascii=False)
        start = text.find(quoted, base) + 1
        assert start > 0, (quoted, text)
        ends += [start + m.end() for m in re.finditer(r"\S+", value)]
        base = start + len(value)
    return [token_at[pos] for pos in ends if pos in token_at]


def optimizer_step(model, opt, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def copy_pool(tok, kind: str) -> torch.Tensor:
    """Token ids the copy rows draw from. `letters`: every token that is letters only (1,412 of
    the committed tokenizer's 2,050), the pieces any ASCII name is made of; `names`: those, the
    byte pieces of the accented letters of demo/corpus.py (no merge holds them), and the space
    token as about one draw in ten, so that copies cross the spaces of multi-word names and the
    bytes of accented ones; `all`: every non-special token but the newline. A copy circuit
    learned on one pool does not carry over to tokens outside it (probe: 1.4% on the full
    vocabulary after training on 512 tokens), so the pool must hold every piece of the names to
    copy."""
    import re

    special = {tok.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_CALL_TOKENS}
    newline = tok.encode("\n", add_special_tokens=False).ids[0]
    ids = [
        i
        for i in range(tok.get_vocab_size(with_added_tokens=True))
        if i not in special and i != newline
    ]
    if kind == "all":
        return torch.tensor(ids)
    letters = [i for i in ids if re.fullmatch(r"[^\W\d_]+", tok.decode([i]))]
    if kind == "letters":
        return torch.tensor(letters)
    accented = "".join(ACCENTS.values())
    accented += accented.upper()
    pieces = sorted(set(tok.encode(accented, add_special_tokens=False).ids) - set(letters))
    space = tok.encode(" ", add_special_tokens=False).ids
    pool = letters + pieces
    return torch.tensor(pool + space * (len(pool) // 9))


def copy_batch(
    pool: torch.Tensor,
    n: int,
    max_len: int,
    min_len: int,
    bos: int,
    gen: torch.Generator,
    alphabet: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of 2 * max_len + 1 tokens: [BOS] filler x x, x of `max_len` random pool tokens, or of
    U[min_len, max_len] when min_len > 0 (the copy offset then varies). Labels on the second x;
    `mask` marks its tokens after the first (those a copy predicts), for the accuracy.
    `alphabet` > 0: each row's tokens come from its own U[alphabet // 2, alphabet] draws of the
    pool, so tokens repeat within x and the token after one occurrence of the current token is
    not always the next one to copy: the copy must match more than the last token (names repeat
    pieces: "Frédéric", "Hong Kong", "Achebe")."""
    width = 2 * max_len + 1
    ids = pool[torch.randint(len(pool), (n, width), generator=gen)]
    if alphabet:
        sizes = torch.randint(alphabet // 2, alphabet + 1, (n, 1), generator=gen)
        subsets = pool[torch.randint(len(pool), (n, alphabet), generator=gen)]
        # each row's draws land in the first `size` entries of its subset: [n, width]
        repeats = subsets.gather(1, (torch.rand((n, width), generator=gen) * sizes).long())
    ids[:, 0] = bos
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i in range(n):
        length = (
            int(torch.randint(min_len, max_len + 1, (1,), generator=gen)) if min_len else max_len
        )
        start = width - 2 * length
        if alphabet:  # x from the row's few tokens; the filler stays the pool's
            ids[i, start : start + length] = repeats[i, start : start + length]
        ids[i, start + length :] = ids[i, start : start + length]
        labels[i, start + length :] = ids[i, start + length :]
        mask[i, start + length + 1 :] = True
    return ids, labels, mask


@torch.no_grad()
def copy_accuracy(model, batch) -> float:
    ids, _, mask = batch
    was_training = model.training
    model.eval()
    pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    model.train(was_training)
    m = mask[:, 1:]
    return (pred[m] == ids[:, 1:][m]).float().mean().item()


def copy_pretrain(model, tok, cfg: dict, log_every: int = 50) -> None:
    """Grow a copy (induction) circuit before the corpus: on chat text alone, or with copy rows
    mixed in from the start, this model never learned to copy (demo/README.md, runs 5 and 6).
    A two-stage curriculum does: stage 1 copies at a fixed offset (learned in about 150 steps,
    as a positional shortcut), stage 2 at variable offsets from those weights (a phase change
    after some hundreds of steps turns it into a real content-matched copy). AdamW without
    weight decay, constant lr after warm-up, batch 16 rows of 49 tokens. Each stage stops at
    `copy_stop` accuracy on 128 held-out rows or after its step budget."""
    pool = copy_pool(tok, cfg["copy_pool"])
    bos = tok.token_to_id(BOS)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg["copy_lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    gen = torch.Generator().manual_seed(SEED + 7)
    print(
        f"copy pre-training: pool {cfg['copy_pool']} ({len(pool)} tokens), stages of "
        f"{cfg['copy_stage1']} and {cfg['copy_stage2']} steps at most",
        flush=True,
    )
    model.train()
    t0 = time.perf_counter()
    stages = [(cfg["copy_stage1"], 0, 0), (cfg["copy_stage2"], 4, 0)]
    if cfg.get("copy_stage3"):
        stages.append((cfg["copy_stage3"], 4, REPEAT_ALPHABET))
    for stage, (max_steps, min_len, alphabet) in enumerate(stages, 1):
        if stage == 3:  # repeats: the pieces of names, spaces and accents (copy_mix_pool)
            pool = copy_pool(tok, cfg["copy_mix_pool"])
        held_out = copy_batch(
            pool, 128, 24, min_len, bos, torch.Generator().manual_seed(SEED + 99), alphabet
        )
        recent: list[float] = []
        for step in range(max_steps):
            for group in opt.param_groups:
                group["lr"] = cfg["copy_lr"] * min(1.0, (step + 1) / 50)
            ids, labels, _ = copy_batch(pool, 16, 24, min_len, bos, gen, alphabet)
            loss = reply_loss(model, ids, labels)
            optimizer_step(model, opt, loss)
            recent = (recent + [loss.item()])[-log_every:]
            if (step + 1) % log_every == 0 or step + 1 == max_steps:
                acc = copy_accuracy(model, held_out)
                print(
                    f"copy stage {stage} step {step + 1}/{max_steps}  loss {sum(recent) / len(recent):.3f}  "
                    f"copy acc {acc:.3f}  elapsed {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
                if acc >= cfg["copy_stop"]:
                    break
    if cfg.get("copy_stage4"):
        span_pretrain(model, tok, opt, cfg, log_every, t0)


def span_pretrain(model, tok, opt, cfg: dict, log_every: int, t0: float) -> None:
    """Stage 4: copies that must stop where the name ends (demo/span_rows.py), until
    `copy_stop` of 128 held-out rows are right to the last token or `copy_stage4` steps."""
    pieces, bos = span_pieces(tok), tok.token_to_id(BOS)
    held_out = span_batch(pieces, 128, bos, random.Random(SEED + 97))
    rng = random.Random(SEED + 5)
    recent: list[float] = []
    for step in range(cfg["copy_stage4"]):
        for group in opt.param_groups:
            group["lr"] = cfg["copy_lr"] * min(1.0, (step + 1) / 50)
        ids, labels, _ = span_batch(pieces, 16, bos, rng)
        loss = reply_loss(model, ids, labels)
        optimizer_step(model, opt, loss)
        recent = (recent + [loss.item()])[-log_every:]
        if (step + 1) % log_every == 0 or step + 1 == cfg["copy_stage4"]:
            acc = span_accuracy(model, held_out)
            print(
                f"copy stage 4 step {step + 1}/{cfg['copy_stage4']}  loss {sum(recent) / len(recent):.3f}  "
                f"rows right {acc:.3f}  elapsed {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
            if acc >= cfg["copy_stop"]:
                break


def span_pieces(tok) -> SpanPieces:
    return SpanPieces(tok, {tok.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_CALL_TOKENS})


def build_model(cfg: dict, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def reply_loss(
    model, input_ids: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token loss on reply tokens only, each scaled by its label's `weights` if given; the
    vocabulary projection runs on those rows alone (about a fifth of the tokens), which saves a
    quarter of a step's time."""
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [batch, seq - 1, hidden]
    targets = labels[:, 1:]
    weights = None if weights is None else weights[:, 1:]
    if REPLY_ONLY:
        # A boolean gather costs more than it saves when every token is labelled.
        mask = targets != -100
        hidden, targets = hidden[mask], targets[mask]  # [num_targets, hidden]
        weights = None if weights is None else weights[mask]
    logits = model.lm_head(hidden)
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if weights is None:
        return torch.nn.functional.cross_entropy(logits, targets)
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return (losses * weights.reshape(-1)).mean()


def train(
    model, ids: torch.Tensor, labels: torch.Tensor, cfg: dict, log_every: int, tok=None
) -> float:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    steps, batch = cfg["steps"], cfg["batch_size"]
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(SEED))
    mix = cfg.get("copy_mix", 0.0)
    if mix:
        # A batch of variable-offset copy rows every step, its loss weighted by `mix`, keeps the
        # copy circuit of the pre-training alive while the corpus is learned.
        pool, bos = copy_pool(tok, cfg["copy_mix_pool"]), tok.token_to_id(BOS)
        copy_gen = torch.Generator().manual_seed(SEED + 11)
        held_out = copy_batch(pool, 128, 24, 4, bos, torch.Generator().manual_seed(SEED + 99))
        num_repeat = round(16 * cfg.get("copy_mix_repeat", 0.0))
        if num_repeat:
            held_out_repeat = copy_batch(
                pool, 128, 24, 4, bos, torch.Generator().manual_seed(SEED + 98), REPEAT_ALPHABET
            )
        num_span = round(16 * cfg.get("copy_mix_span", 0.0))
        if num_span:
            pieces, span_rng = span_pieces(tok), random.Random(SEED + 6)
            held_out_span = span_batch(pieces, 128, bos, random.Random(SEED + 97))
    num_calls = cfg.get("call_mix", 0)
    if num_calls:
        # `num_calls` more rows every step, requests about made-up names and their calls: the
        # corpus holds only a few such calls a step, too few to learn where a copied name ends;
        # and chat turns (`call_chat`), which keep the answers from copying the question.
        call_ids, call_labels, call_weights = call_rows(
            tok, drill_conversations(cfg), cfg.get("call_end_weight", 1.0)
        )
    model.train()
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(steps):
        rows = order[(torch.arange(batch) + step * batch) % ids.shape[0]]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = reply_loss(model, ids[rows], labels[rows])
        total = loss
        if mix:
            plain = 16 - num_repeat - num_span
            copy_ids, copy_labels, _ = copy_batch(pool, plain, 24, 4, bos, copy_gen)
            if num_repeat:
                more = copy_batch(pool, num_repeat, 24, 4, bos, copy_gen, REPEAT_ALPHABET)
                copy_ids = torch.cat([copy_ids, more[0]])
                copy_labels = torch.cat([copy_labels, more[1]])
            total = loss + mix * reply_loss(model, copy_ids, copy_labels)
            if num_span:  # rows of another width: their own loss, weighted by their share
                span_ids, span_labels, _ = span_batch(pieces, num_span, bos, span_rng)
                span_loss = reply_loss(model, span_ids, span_labels)
                total = total + mix * num_span / 16 * span_loss
        if num_calls:
            rows = slice(step * num_calls, (step + 1) * num_calls)
            width = int((call_ids[rows] != tok.token_to_id(PAD)).sum(1).max())
            total = total + reply_loss(
                model, call_ids[rows, :width], call_labels[rows, :width], call_weights[rows, :width]
            )
        optimizer_step(model, opt, total)
        recent = (recent + [loss.item()])[-log_every:]
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - t0
            eta = elapsed / (step + 1) * (steps - step - 1)
            acc = f"  copy acc {copy_accuracy(model, held_out):.3f}" if mix else ""
            if mix and num_repeat:
                acc += f" (repeats {copy_accuracy(model, held_out_repeat):.3f})"
            if mix and num_span:
                acc += f" (ending rows right {span_accuracy(model, held_out_span):.3f})"
            print(
                f"step {step + 1}/{steps}  loss {sum(recent) / len(recent):.4f}{acc}  lr {lr_at(step):.2e}  "
                f"elapsed {elapsed:.0f}s  eta {eta:.0f}s",
                flush=True,
            )
    return sum(recent) / len(recent)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def save(out: str, model, tok, cfg: dict, tok_files: dict[str, bytes] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    if tok_files:
        # The reused tokenizer's files byte for byte (read before training: `out` may be their folder).
        for name, data in tok_files.items():
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)
        return
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(model.config.max_position_embeddings), f, indent=2)
        f.write("\n")
    eos = tok.token_to_id(EOS)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(
            {
                "bos_token_id": tok.token_to_id(BOS),
                "eos_token_id": eos,
                "pad_token_id": tok.token_to_id(PAD),
            },
            f,
            indent=2,
        )
        f.write("\n")


def override(cfg: dict, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """The flags among `names` that were given replace the configuration's values."""
    for name in names:
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)


def seed_everything(seed: int, threads: int | None) -> None:
    """Seeded and deterministic, on `threads` torch threads (None: all cores)."""
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def default(key: str) -> str:
    """A flag's default for its help: FULL's, and --draft's and --quick's where they differ."""
    parts = [f"default {FULL[key]}"]
    for flag, cfg in (("--draft", DRAFT), ("--quick", QUICK)):
        if cfg.get(key, FULL[key]) != FULL[key]:
            parts.append(f"{flag}: {cfg[key]}")
    return "; ".join(parts)


# Flags that override a configuration value: (name, type or choices, help without the default).
OVERRIDES = (
    ("steps", int, "training steps"),
    ("layers", int, "transformer layers"),
    ("novel", float, "share of weather and search requests about made-up names"),
    (
        "names",
        ["plain", "rich"],
        "made-up names: plain (one or two words) or rich (accents, up to three words, "
        "people's names in searches)",
    ),
    ("novel_multi", float, "share of those made-up names of several words, None for 34%%"),
    (
        "known_first",
        float,
        "share of made-up names of several words whose first word is a known city",
    ),
    ("copy_stage1", int, "copy pre-training, stage 1 (fixed offset): steps at most (0: none)"),
    ("copy_stage2", int, "copy pre-training, stage 2 (variable offsets): steps at most"),
    ("copy_lr", float, "copy pre-training lr"),
    ("copy_stop", float, "a copy stage ends at this held-out copy accuracy"),
    (
        "copy_pool",
        ["letters", "names", "all"],
        "tokens the copy pre-training rows draw from (letters: the letters-only tokens)",
    ),
    ("copy_mix", float, "weight of a batch of 16 copy rows added to every corpus step (0: none)"),
    (
        "copy_mix_pool",
        ["letters", "names", "all"],
        "tokens the mixed-in copy rows draw from (names: letters, the byte pieces of accented "
        "letters, spaces)",
    ),
    (
        "copy_stage3",
        int,
        "copy pre-training, stage 3 (rows whose tokens repeat, from --copy-mix-pool): steps at most",
    ),
    ("copy_mix_repeat", float, "share of the mixed-in copy rows whose tokens repeat"),
    (
        "copy_stage4",
        int,
        "copy pre-training, stage 4 (copies that stop where a name ends, demo/span_rows.py): "
        "steps at most",
    ),
    ("copy_mix_span", float, "share of the mixed-in copy rows that are stage 4's"),
    ("call_mix", int, "rows of a request about a made-up name and its call added to every step"),
    ("call_answer", float, "share of those rows that are an answer from a weather result instead"),
    ("call_chat", float, "share of the rest that are chat turns instead"),
    ("call_multi", float, "share of their calls whose name has several words"),
    ("call_tail", float, "share of their requests with words after the name"),
    (
        "call_end_weight",
        float,
        "loss weight of the token after each word of their calls' arguments, where the copy "
        "goes on or stops",
    ),
    ("vocab_size", int, "a trained tokenizer's vocabulary at most"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default demo/tandem-demo, --draft: "
        "demo/tandem-demo-draft; --quick: a temp folder)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, about a minute")
    parser.add_argument(
        "--draft", action="store_true", help="a drafter for demo/tandem-demo, with its tokenizer"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the folder whose tokenizer is reused (default demo/tandem-demo)",
    )
    for name, kind, text in OVERRIDES:
        typed = {"choices": kind} if isinstance(kind, list) else {"type": kind}
        parser.add_argument(
            "--" + name.replace("_", "-"), default=None, help=f"{text} ({default(name)})", **typed
        )
    parser.add_argument(
        "--new-tokenizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"train a tokenizer on the corpus, else reuse --target's ({default('new_tokenizer')})",
    )
    parser.add_argument(
        "--name-spaces",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a trained tokenizer's spaces inside names are a token of their own, NAME_SPACE "
        f"({default('name_spaces')})",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    return parser


def config(args: argparse.Namespace) -> dict:
    """The training configuration these flags give (FULL, DRAFT or QUICK, and the overrides)."""
    cfg = dict(QUICK if args.quick else DRAFT if args.draft else FULL)
    names = tuple(name for name, _, _ in OVERRIDES) + ("new_tokenizer", "name_spaces")
    override(cfg, args, names)
    return cfg


def main() -> None:
    args = build_parser().parse_args()
    cfg = config(args)
    here = os.path.dirname(os.path.abspath(__file__))
    target = None if cfg["new_tokenizer"] else (args.target or os.path.join(here, "tandem-demo"))
    out = args.out or (
        tempfile.mkdtemp(prefix="tandem-demo-")
        if args.quick
        else os.path.join(here, "tandem-demo-draft" if args.draft else "tandem-demo")
    )
    seed_everything(SEED, args.threads)
    t_start = time.perf_counter()

    render = make_renderer()
    texts = [render(messages, tools) for messages, tools in corpus_conversations(cfg)]
    tok = (
        load_target_tokenizer(target)
        if target
        else train_tokenizer(texts, cfg["vocab_size"], cfg["name_spaces"])
    )
    tok_files = None
    if target:
        tok_files = {}
        for name in TOKENIZER_FILES:
            with open(os.path.join(target, name), "rb") as f:
                tok_files[name] = f.read()
    ids, labels = pack(tok, texts, cfg["seq_len"])
    num_targets = int((labels != -100).sum())
    print(
        f"corpus: {len(texts)} conversations, {ids.numel()} tokens in {ids.shape[0]} rows of {cfg['seq_len']}, "
        f"{num_targets} labelled tokens; vocab {tok.get_vocab_size(with_added_tokens=True)} "
        f"({time.perf_counter() - t_start:.0f}s)",
        flush=True,
    )
    seen = cfg["steps"] * cfg["batch_size"] / ids.shape[0]
    print(
        f"training {cfg['steps']} steps x {cfg['batch_size']} rows ({seen:.2f} epochs), "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )

    model = build_model(cfg, tok)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    if cfg["copy_stage1"] or cfg["copy_stage2"]:
        copy_pretrain(model, tok, cfg, log_every=10 if args.quick else 50)
    final_loss = train(model, ids, labels, cfg, log_every=10 if args.quick else 50, tok=tok)
    save(out, model, tok, cfg, tok_files)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
        f"saved {out} ({size / 1e6:.1f} MB); final loss {final_loss:.4f}; "
        f"total {time.perf_counter() - t_start:.0f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()
