"""The batch machinery without files of records: synthetic tokens, token files, packing, resume by
global sample index, eval windows, and the loss (mean over labels under loss, per-document attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardconsole.settings import config as C
from shardconsole.backends.data.corpus import DOC_START, LOSS
from shardconsole.backends.data.batches import (IGNORE, DataError, EvalWindows, PackedWindows, SyntheticTokens,
                                        _token_file, windows_to_batch)
from shardconsole.backends.model.modeling import CausalLMLoss, chunked_cross_entropy


def cfg_for(**data) -> C.RunConfig:
    cfg = C.RunConfig()
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_synthetic_is_learnable_and_differs_per_rank():
    a, b = SyntheticTokens(256, 32, seed=1, rank=0, world=2), SyntheticTokens(256, 32, seed=1, rank=1, world=2)
    xa, xb = a.batch(4), b.batch(4)
    assert xa.inputs.shape == (4, 32) and xa.positions is None and int(xa.inputs.max()) < 256
    assert not torch.equal(xa.inputs, xb.inputs)
    assert torch.equal(xa.inputs[:, 1:], xa.labels[:, :-1])      # labels are the next tokens, all under loss
    # The next token is a fixed function of the current one, the same on every rank.
    nxt = {}
    for x, y in ((xa.inputs, xa.labels), (xb.inputs, xb.labels)):
        for cur, n in zip(x.flatten().tolist(), y.flatten().tolist()):
            assert nxt.setdefault(cur, n) == n


def _rows(src, steps: int, micro: int) -> list[list[int]]:
    return [row for _ in range(steps) for row in src.batch(micro).inputs.tolist()]


@pytest.mark.parametrize("kind", ["synthetic", "packed"])
def test_resume_sees_the_batches_of_the_uninterrupted_run_on_any_world_size(kind):
    """Global samples 0..15 are the same whether one rank or two take them, and a source that seeks
    to sample 8 continues exactly where the uninterrupted one was (4 steps of 2 samples on one rank)."""
    ids = np.arange(2000) % 97

    def source(rank, world):
        if kind == "synthetic":
            return SyntheticTokens(256, 8, seed=3, rank=rank, world=world)
        return PackedWindows(ids, None, 8, seed=3, rank=rank, world=world, name="t")
    whole = _rows(source(0, 1), 8, 2)                       # 16 samples, in global order
    later = source(0, 1)
    later.seek(8)
    assert _rows(later, 4, 2) == whole[8:]
    r0, r1 = source(0, 2), source(1, 2)
    for s in (r0, r1):
        s.seek(8)
    # On two ranks, micro-batch j of a step holds samples consumed + 2j + rank.
    got0, got1 = _rows(r0, 2, 2), _rows(r1, 2, 2)
    assert got0 == [whole[8], whole[10], whole[12], whole[14]]
    assert got1 == [whole[9], whole[11], whole[13], whole[15]]


def test_epochs_reshuffle_and_cover_every_window():
    ids = np.arange(81)                                      # 10 windows of 8 (+1 overlap)
    src = PackedWindows(ids, None, 8, seed=0, rank=0, world=1, name="t")
    first = [row[0] for row in _rows(src, 10, 1)]
    second = [row[0] for row in _rows(src, 10, 1)]
    assert sorted(first) == sorted(second) == list(range(0, 80, 8))
    assert first != second


def test_positions_restart_at_each_document_and_first_tokens_are_not_labels():
    ids = np.array([[10, 11, 12, 13, 20, 21, 22, 30, 31]])
    flags = np.array([[DOC_START, 1, 1, 1, DOC_START, 1, 1, DOC_START, 1]], dtype=np.uint8)
    b = windows_to_batch(ids, flags, cross_doc=False)
    assert b.inputs.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    # A document's first token is never predicted from the one before it.
    assert b.labels.tolist() == [[11, 12, 13, IGNORE, 21, 22, IGNORE, 31]]
    assert windows_to_batch(ids, flags, cross_doc=True).positions is None
    # A window that starts inside a document counts positions from its own start.
    mid = windows_to_batch(ids[:, 2:], flags[:, 2:], cross_doc=False)
    assert mid.positions.tolist() == [[0, 1, 0, 1, 2, 0]]


def test_eval_windows_cover_every_label_once_with_the_same_batch_count_on_every_rank():
    n_tok = 8 * 5 + 4                                        # 5 full windows and a partial one: 6 windows
    ids = np.arange(1, n_tok + 1)
    flags = np.full(n_tok, LOSS, dtype=np.uint8)
    flags[0] = DOC_START
    seen: list[int] = []
    counts = []
    for rank in range(4):
        ev = EvalWindows(ids, flags, 8, rank, 4, cross_doc=True)
        batches = list(ev.batches(micro_batch=1))
        counts.append(len(batches))
        for b in batches:
            assert b.inputs.shape == (1, 8)
            seen += [v for v in b.labels.flatten().tolist() if v != IGNORE]
    assert counts == [2, 2, 2, 2]                            # ranks 2 and 3 run a padding window each
    assert sorted(seen) == list(range(2, n_tok + 1))         # every token but the first, exactly once


def test_token_file_memmap(tmp_path):
    f = tmp_path / "tok.bin"
    np.arange(1000, dtype=np.uint16).tofile(f)
    src = _token_file(cfg_for(source="tokens", path=str(f), seq_len=10), 1000, 0, 2)
    assert isinstance(src.ids, np.memmap)
    row = src.windows(1)[0][0]
    assert (row[1:] - row[:-1] == 1).all()
    with pytest.raises(DataError, match="vocab_size is 500"):
        _token_file(cfg_for(source="tokens", path=str(f), seq_len=10), 500, 0, 2)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="multiple of 2 bytes"):
        _token_file(cfg_for(source="tokens", path=str(odd), seq_len=2), 1000, 0, 1)


def test_too_little_data_for_the_ranks():
    with pytest.raises(DataError, match="fewer than the 2 ranks"):
        PackedWindows(np.arange(10), None, 8, seed=0, rank=0, world=2, name="short.txt")


# ---------------------------------------------------------------------------------------------------
# The loss

@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      vocab_size=64, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return CausalLMLoss(LlamaForCausalLM(cfg).eval())


def test_loss_is_the_mean_over_labels_under_loss(tiny_lm):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 12), generator=g)
    y = torch.randint(0, 64, (2, 12), generator=g)
    y[0, :5] = IGNORE
    with torch.no_grad():
        logits = tiny_lm.lm(input_ids=x).logits.float()
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1), reduction="none",
                                                      ignore_index=IGNORE)
        mean = tiny_lm(x, y)
        s, n = tiny_lm(x, y, None, reduction="sum")
    assert int(n) == 24 - 5
    assert torch.allclose(mean, per_token.sum() / 19, atol=1e-6)
    assert torch.allclose(s, per_token.sum(), atol=1e-5)
    # No label under loss: zero, with a gradient that exists (a prompt-only window must not break backward).
    none = torch.full_like(y, IGNORE)
    loss = tiny_lm(x, none)
    assert float(loss.detach()) == 0.0
    loss.backward()


def test_chunked_cross_entropy_matches_the_plain_one_with_ignored_labels():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(3, 50, 16, generator=g), torch.randn(40, 16, generator=g)
    y = torch.randint(0, 40, (3, 50), generator=g)
    y[:, ::3] = IGNORE
    plain = torch.nn.functional.cross_entropy((h @ w.t()).reshape(-1, 40), y.reshape(-1), ignore_index=IGNORE)
    assert torch.allclose(chunked_cross_entropy(h, w, y, chunk_tokens=7), plain, atol=1e-5)


def test_restarted_positions_keep_documents_apart(tiny_lm):
    """With positions restarting at a document, its tokens' losses are those of the document alone:
    nothing before it in the window is attended to. With positions 0..S-1 they differ."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 64, (1, 7), generator=g), torch.randint(0, 64, (1, 6), generator=g)
    x = torch.cat([a, b], 1)
    y = torch.full_like(x, IGNORE)
    y[0, 7:-1] = b[0, 1:]
    yb = torch.full_like(b, IGNORE)
    yb[0, :-1] = b[0, 1:]
    pos = torch.tensor([list(range(7)) + list(range(6))])
    with torch.no_grad():
        alone = tiny_lm(b, yb)
        packed = tiny_lm(x, y, pos)
        across = tiny_lm(x, y)
    assert torch.allclose(packed, alone, atol=1e-5)
    assert not torch.allclose(across, alone, atol=1e-3)


def test_evaluate_without_a_process_group_is_the_token_mean(tiny_lm):
    from shardconsole.backends.objective.held_out_loss import evaluate
    n_tok = 8 * 3 + 2
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 64, (n_tok,), generator=g).numpy()
    flags = np.full(n_tok, LOSS, dtype=np.uint8)
    flags[0] = DOC_START
    flags[10:14] = 0                                         # a prompt: not under loss
    ev = EvalWindows(ids, flags, 8, 0, 1, cross_doc=True)
    loss, tokens = evaluate(tiny_lm, ev, micro_batch=2, device=torch.device("cpu"))
    assert tokens == n_tok - 1 - 4
    # By hand: each window's summed token loss, over the labels under loss.
    total = 0.0
    with torch.no_grad():
        for o in range(0, n_tok - 1, 8):
            x = torch.from_numpy(ids[o:o + 8][None]).long()
            nxt = torch.from_numpy(ids[o + 1:o + 9][None]).long()
            keep = torch.from_numpy(flags[o + 1:o + 9][None] & LOSS).bool()
            lab = torch.where(keep, nxt, torch.full_like(nxt, IGNORE))
            x = x[:, :lab.shape[1]]
            total += float(tiny_lm(x, lab, reduction="sum")[0])
    assert loss == pytest.approx(total / tokens, rel=1e-5)
