"""The expert cache of --mem-budget (backends/streaming/experts.py) and the plan that sizes it (budget.py):
hits and misses counted per (layer, expert), the least used evicted, the bytes read are the file's,
a short read is one clean error, the next layer's predicted experts read ahead only into entries
the current layer does not use, and the plan stays within the budget."""
from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import ggml
import numpy as np
import pytest

from gguf_arch.errors import KimiError
from gguf_arch.io.direct_io import BLOCK, open_direct
from ggml_graph_spec.backends.streaming.budget import BudgetError, ExpertSizes, plan_budget
from ggml_graph_spec.backends.streaming.experts import ExpertCache, ExpertStack, ShortReadError

STRIDES = (96, 64, 128)  # bytes of one expert of each kind (gate, up, down)
N_EXPERTS = 8


@pytest.fixture
def stacks(tmp_path):
    """Two layers' stacks of N_EXPERTS experts in one file, every byte distinct per slice."""
    data = np.random.default_rng(0).integers(0, 256, 2 * N_EXPERTS * sum(STRIDES), dtype=np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    out, off = {}, 0
    for layer in (0, 1):
        out[layer] = []
        for stride in STRIDES:
            out[layer].append(ExpertStack(None, fd, str(path), off, stride, N_EXPERTS))
            off += stride * N_EXPERTS
    yield out, data
    os.close(fd)


_BACKEND = ggml.ggml_backend_cpu_init()  # for its buffer type; one for the module


def _cache(entries: int) -> ExpertCache:
    kinds = [(ggml.GGML_TYPE_I8, s, 1, s) for s in STRIDES]
    return ExpertCache(kinds, entries, ggml.ggml_backend_get_default_buffer_type(_BACKEND))


def _held(cache: ExpertCache, entry: int, kind: int, stack: ExpertStack | None = None) -> bytes:
    if stack is None:  # the contiguous layout: entry i of a kind is i strides into its region
        return ctypes.string_at(cache.bases[kind] + int(entry) * STRIDES[kind], STRIDES[kind])
    return ctypes.string_at(cache.address(kind, int(entry), stack), stack.stride)


def test_hits_misses_and_the_bytes_read(stacks):
    s, data = stacks
    c = _cache(3)
    try:
        e = c.place(1, s[1], np.array([2, 5]))
        assert (c.hits, c.misses) == (0, 2) and c.bytes_read == 2 * sum(STRIDES)
        for entry, expert in zip(e, (2, 5)):
            for kind, stack in enumerate(s[1]):
                lo = stack.file_offset + expert * stack.stride
                assert _held(c, entry, kind) == data[lo:lo + stack.stride].tobytes()
        assert list(c.place(1, s[1], np.array([2, 5]))) == list(e)
        assert (c.hits, c.misses) == (2, 2) and c.bytes_read == 2 * sum(STRIDES)
        c.place(0, s[0], np.array([2]))  # another layer's expert 2 is another expert
        assert (c.hits, c.misses) == (2, 3) and c.hit_rate() == pytest.approx(2 / 5)
        assert c.place(1, s[1], np.array([0, 1, 2, 3])) is None  # more than the cache holds
    finally:
        c.free()


def test_the_least_used_is_evicted_ties_to_the_least_recent(stacks):
    s, _ = stacks
    c = _cache(3)
    try:
        for ids in ([1, 2], [1, 2], [1, 3]):  # uses: 1 x3, 2 x2, 3 x1
            c.place(0, s[0], np.array(ids))
        c.place(0, s[0], np.array([4]))  # evicts 3 (used once)
        c.place(0, s[0], np.array([1]))
        assert (0, 3) not in c._where and {(0, 1), (0, 2), (0, 4)} == set(c._where)
        c.place(0, s[0], np.array([5]))  # 4 (once) is the least used again
        c.place(0, s[0], np.array([6]))  # 5 used once, the others more
        assert {(0, 1), (0, 2), (0, 6)} == set(c._where)
        c.place(0, s[0], np.array([6, 7]))  # the selected 6 stays, the least used other goes: 2
        assert {(0, 1), (0, 6), (0, 7)} == set(c._where)
    finally:
        c.free()
    c = _cache(2)
    try:
        for ids in ([1], [2], [3]):  # 1 and 2 used once each: the less recent, 1, goes
            c.place(0, s[0], np.array(ids))
        assert {(0, 2), (0, 3)} == set(c._where)
    finally:
        c.free()
    c = _cache(3)
    try:  # the last empty entry and one held: 1 and 2 used as often and as lately, the lower goes
        c.place(0, s[0], np.array([1, 2]))
        c.place(0, s[0], np.array([3, 4]))
        assert {(0, 2), (0, 3), (0, 4)} == set(c._where) and c.misses == 4
    finally:
        c.free()


def test_a_short_read_is_one_clean_error(stacks, tmp_path):
    s, _ = stacks
    beyond = [ExpertStack(None, st.fd, st.path, st.file_offset + 10**6, st.stride, st.count) for st in s[1]]
    c = _cache(2)
    try:
        with pytest.raises(ShortReadError, match="experts.bin: short read at offset") as err:
            c.place(1, beyond, np.array([0]))
        assert isinstance(err.value, KimiError) and "\n" not in str(err.value)
    finally:
        c.free()


def test_the_plan_stays_within_the_budget_and_pins_trunks_first():
    trunks, fixed = [100] * 6, 1000
    experts = ExpertSizes((0,) + (16,) * 5, 30, 2)
    whole = fixed + sum(trunks) + experts.total
    for budget in range(fixed + 2 * 100 + 2 * 30, whole + 100, 37):
        p = plan_budget(budget, fixed, trunks, experts)
        assert p.resident <= budget, budget
        if budget >= whole:
            assert p.streamed == () and p.cache_entries == 0 and len(p.pinned) == 6
            continue
        assert p.cache_entries >= 2 and p.expert_layers == (1, 2, 3, 4, 5)
        assert p.cache_entries == min(16 * 5, (budget - (p.resident - p.cache_entries * 30)) // 30)
        # trunks are pinned first: while one is streamed, the cache beyond one token's experts
        # could not have held another trunk
        assert p.streamed == () or (p.cache_entries - 2) * 30 < 100
    with pytest.raises(BudgetError, match="one token's 2 experts"):
        plan_budget(fixed + 2 * 100 + 2 * 30 - 1, fixed, trunks, experts)


def test_predicted_reads_fall_with_the_budget():
    trunks, experts = [100] * 6, ExpertSizes((0,) + (16,) * 5, 30, 2)
    reads = [plan_budget(b, 1000, trunks, experts).predicted_bytes_per_token for b in range(1260, 3800, 100)]
    assert all(a >= b for a, b in zip(reads, reads[1:])) and reads[0] > reads[-1]
    assert reads[0] <= 6 * 100 + 5 * 2 * 30


def _expert_bytes(stacks, layer: int, expert: int, kind: int, data) -> bytes:
    st = stacks[layer][kind]
    lo = st.file_offset + expert * st.stride
    return data[lo:lo + st.stride].tobytes()


def _assert_holds(c: ExpertCache, s, data, layer: int, experts) -> None:
    for e in experts:
        for kind in range(len(STRIDES)):
            assert _held(c, c._where[(layer, e)], kind) == _expert_bytes(s, layer, e, kind, data), (layer, e, kind)


def test_a_prefetch_never_evicts_what_the_current_layer_uses(stacks):
    """Scripted: a full cache of four; layer 0 uses 1 and 2 while 5, 6, 7 are predicted for
    layer 1: only 3 and 4 (the least used others) make room, two reads are issued; layer 1 then
    selects 5 and 7: 5 was read ahead (useful), 6 is let go (wasted), 7 is read now."""
    s, data = stacks
    c = _cache(4)
    try:
        c.place(0, s[0], np.array([1, 2]))
        c.place(0, s[0], np.array([3, 4]))
        used = c.place(0, s[0], np.array([1, 2]), ahead=(1, s[1], np.array([5, 6, 7])))
        assert c.predicted == 2 and {(0, 1), (0, 2), (1, 5), (1, 6)} == set(c._where)
        assert [c._where[(0, 1)], c._where[(0, 2)]] == list(used)
        _assert_holds(c, s, data, 0, [1, 2])  # the current layer's entries, untouched
        hits, misses = c.hits, c.misses
        c.place(1, s[1], np.array([5, 7]))
        assert (c.useful, c.wasted) == (1, 1) and c.useful + c.wasted == c.predicted
        assert (c.hits, c.misses) == (hits, misses + 2)  # a useful prefetch had to be read: a miss
        assert (1, 6) not in c._where
        _assert_holds(c, s, data, 1, [5, 7])
        _assert_holds(c, s, data, 0, [1, 2])
    finally:
        c.free()


def test_a_prefetch_uses_only_entries_the_current_layer_leaves(stacks):
    s, data = stacks
    c = _cache(3)
    try:  # three experts used, three predicted: no entry is free, nothing is read ahead
        c.place(0, s[0], np.array([1, 2, 3]), ahead=(1, s[1], np.array([1, 2, 3])))
        assert c.predicted == 0 and {(0, 1), (0, 2), (0, 3)} == set(c._where)
        c.place(0, s[0], np.array([1]), ahead=(1, s[1], np.array([0, 4])))  # 2 and 3 make room
        c.place(1, s[1], np.array([4, 0]))
        assert (c.predicted, c.useful, c.wasted) == (2, 2, 0)
        _assert_holds(c, s, data, 1, [0, 4])
    finally:
        c.free()


def test_a_failed_prefetch_is_the_same_clean_error(stacks):
    """A short read in a read ahead surfaces, as ShortReadError, when its layer waits for it."""
    s, _ = stacks
    beyond = [ExpertStack(None, st.fd, st.path, st.file_offset + 10**6, st.stride, st.count) for st in s[1]]
    c = _cache(4)
    try:
        c.place(0, s[0], np.array([1]), ahead=(1, beyond, np.array([0])))  # no error yet: not waited for
        assert c.predicted == 1
        with pytest.raises(ShortReadError, match="experts.bin: short read at offset") as err:
            c.place(1, beyond, np.array([0]))
        assert isinstance(err.value, KimiError) and "\n" not in str(err.value)
    finally:
        c.free()


def test_reads_around_the_page_cache_are_the_file_bytes(stacks):
    """O_DIRECT reads (unaligned offsets and lengths, widened to blocks) hold the file's bytes; a
    short one is the same clean error."""
    s, data = stacks
    direct = open_direct(s[0][0].fd, s[0][0].path)
    if direct is None:
        pytest.skip("the file system of the test's tmp_path refuses O_DIRECT")
    try:
        d = {l: [replace(st, direct=direct) for st in v] for l, v in s.items()}
        c = _cache(3)
        try:
            c.place(1, d[1], np.array([0, 3, 7]))
            _assert_holds(c, s, data, 1, [0, 3, 7])
            beyond = [replace(st, file_offset=st.file_offset + 10**6) for st in d[0]]
            with pytest.raises(ShortReadError, match="experts.bin: short read at offset"):
                c.place(0, beyond, np.array([1]))
        finally:
            c.free()
    finally:
        os.close(direct)


BLOCK_STRIDES = (2 * BLOCK, BLOCK, 3 * BLOCK)  # experts of whole blocks: a pitched cache


@pytest.fixture
def block_stacks(tmp_path):
    """Three layers' stacks of whole-block experts, each layer at another place in a block."""
    n = 4
    data = np.random.default_rng(1).integers(0, 256, 100 + 3 * (n * sum(BLOCK_STRIDES) + 1000), dtype=np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    direct = open_direct(fd, path)
    out, off = {}, 100
    for layer in range(3):
        out[layer] = []
        for stride in BLOCK_STRIDES:
            out[layer].append(ExpertStack(None, fd, str(path), off, stride, n, direct))
            off += stride * n
        off += 1000  # the next layer's shift differs
    yield out, data
    if direct is not None:
        os.close(direct)
    os.close(fd)


def _block_cache(entries: int, pitched: bool) -> ExpertCache:
    kinds = [(ggml.GGML_TYPE_I8, s, 1, s) for s in BLOCK_STRIDES]
    return ExpertCache(kinds, entries, ggml.ggml_backend_get_default_buffer_type(_BACKEND), pitched)


def test_pitched_entries_hold_each_layer_at_its_shift(block_stacks):
    """Entries reused across layers whose stacks sit at different places in a block: every held
    expert is the file's bytes at the address the layer's graph tensor gives it (data + entry *
    nb[2]), whatever its neighbours hold; the exact path's (not pitched) is contiguous."""
    s, data = block_stacks
    assert {st.file_offset % BLOCK for v in s.values() for st in v[:1]} == {100, 1100, 2100}
    c = _block_cache(3, pitched=True)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 16, mem_buffer=None, no_alloc=True))
    try:
        assert c.pitched and c.pitches == [st + BLOCK for st in BLOCK_STRIDES]
        for layer, experts in ((0, [0, 1, 2]), (1, [3]), (2, [1]), (0, [2]), (1, [0, 3])):
            c.place(layer, s[layer], np.array(experts))
        for (layer, e), entry in c._where.items():
            tensors = c.tensors(ctx, [b"g", b"u", b"d"], s[layer])
            for kind, (t, st) in enumerate(zip(tensors, s[layer])):
                addr = t.contents.data + entry * t.contents.nb[2]
                assert addr == c.address(kind, entry, st) and t.contents.nb[2] == c.pitches[kind]
                lo = st.file_offset + e * st.stride
                assert ctypes.string_at(addr, st.stride) == data[lo:lo + st.stride].tobytes(), (layer, e, kind)
        flat = _block_cache(3, pitched=False)
        assert not flat.pitched and flat.pitches == list(BLOCK_STRIDES)
        flat.free()
    finally:
        ggml.ggml_free(ctx)
        c.free()


def test_a_stopped_read_reads_nothing_more(block_stacks):
    """A read told to stop (a prediction let go) returns the bytes it delivered: none when told first."""
    s, data = block_stacks
    st = s[1][2]
    if st.direct is None:
        pytest.skip("the file system of the test's tmp_path refuses O_DIRECT")
    c = _block_cache(2, pitched=True)
    try:
        addr = c.address(2, 0, st)
        assert st.read(addr, 1, True, lambda: True) == 0
        assert st.read(addr, 1, True) == st.stride
        lo = st.file_offset + st.stride
        assert ctypes.string_at(addr, st.stride) == data[lo:lo + st.stride].tobytes()
    finally:
        c.free()


@pytest.mark.parametrize("offset, nbytes, chunk", [(0, 3 * BLOCK, BLOCK), (100, 5 * BLOCK + 7, 2 * BLOCK),
                                                   (BLOCK - 1, 9000, 3000), (12345, 1 << 20, 1 << 18)])
def test_a_read_in_several_requests_through_the_readers_buffers(tmp_path, offset, nbytes, chunk):
    """The exact path's O_DIRECT reads (not into a pitched entry) in more requests than one, from
    several threads at once (each through its own buffer): the file's bytes; a file ending in a
    later request is the same clean error."""
    from concurrent.futures import ThreadPoolExecutor

    from ggml_graph_spec.backends.streaming.experts import pread_direct_into
    data = np.random.default_rng(2).integers(0, 256, offset + 4 * nbytes, dtype=np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    direct = open_direct(fd, path)
    try:
        if direct is None:
            pytest.skip("the file system of the test's tmp_path refuses O_DIRECT")
        outs = [np.zeros(nbytes, np.uint8) for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: pread_direct_into(direct, str(path), outs[i].ctypes.data, nbytes,
                                                            offset + i * nbytes, chunk=chunk), range(4)))
        assert got == [nbytes] * 4
        for i, out in enumerate(outs):
            assert out.tobytes() == data[offset + i * nbytes:offset + (i + 1) * nbytes].tobytes(), i
        with pytest.raises(ShortReadError, match="experts.bin: short read at offset"):
            pread_direct_into(direct, str(path), outs[0].ctypes.data, nbytes, data.size - nbytes + chunk, chunk=chunk)
    finally:
        if direct is not None:
            os.close(direct)
        os.close(fd)


def _reference_lfu(entries: int, workload: list[tuple[int, list[int]]]) -> list[dict]:
    """The eviction rule as the module docstring states it, by a full scan per miss: after each
    step, (layer, expert) -> entry."""
    where, owner, free, uses, last, out = {}, [None] * entries, list(range(entries)), {}, {}, []
    for tick, (layer, experts) in enumerate(workload, 1):
        keys = [(layer, e) for e in experts]
        if len(keys) <= entries:
            for k in keys:
                uses[k], last[k] = uses.get(k, 0) + 1, tick
            for k in [k for k in keys if k not in where]:
                if free:
                    entry = free.pop(free.index(min(free)))
                else:
                    entry = min((i for i in range(entries) if owner[i] not in keys),
                                key=lambda i: (uses[owner[i]], last[owner[i]], *owner[i]))
                    del where[owner[entry]]
                owner[entry], where[k] = k, entry
        out.append(dict(where))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_eviction_order_is_the_rule_at_every_step(stacks, seed):
    """Random selections (sometimes more than the cache holds) through a small cache for long
    enough that its eviction order is rebuilt several times: after every step the cache holds
    exactly what the rule, applied by a full scan, holds, in the same entries."""
    s, data = stacks
    rng = np.random.default_rng(seed)
    entries = 4 + seed % 2
    workload = [(int(rng.integers(2)), sorted(rng.choice(N_EXPERTS, int(rng.integers(1, 7)), replace=False).tolist()))
                for _ in range(400)]
    want = _reference_lfu(entries, workload)
    c = _cache(entries)
    try:
        for step, (layer, experts) in enumerate(workload):
            c.place(layer, s[layer], np.array(experts))
            assert c._where == want[step], step
            assert len(c._order) <= 5 * entries + 64 + N_EXPERTS
        for layer, e in c._where:
            _assert_holds(c, s, data, layer, [e])
    finally:
        c.free()
