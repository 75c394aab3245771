"""ZeRO 3's forward fetches replayed as DeepSpeed's coordinator makes them at a steady step: which weights share a
flat all-gather buffer, and how long it lives (`xirang_ds.memory.zero3_fetch`)."""
import dataclasses

from tests.harness.engine_runs import ds_config
from xirang_ds.memory.run_shape import RunShape
from xirang_ds.memory.zero3_fetch import Fetch, replay


def forward_fetches(shape, numels, modules):
    return [dataclasses.replace(f, gathered=0, fetched=0) for f in replay(shape, numels, modules).forward]


def _shape(world: int = 2, bucket: float = 5e7, persistence: int = 100, stage: int = 3, reuse: float = 1e9) -> RunShape:
    config = ds_config(stage=stage, dtype="bf16")
    config["zero_optimization"].update(stage3_prefetch_bucket_size=bucket, stage3_max_reuse_distance=reuse,
                                       stage3_param_persistence_threshold=persistence)
    return RunShape.from_ds_config(config, world)


NUMELS = [1000, 2001, 3000, 4000, 50]  # the last is at most the persistence threshold: never fetched
MODULES = [[0], [1], [], [2, 4], [3]]  # a module without weights of its own still prefetches


def test_a_bucket_larger_than_the_model_puts_every_later_weight_in_one_buffer_until_the_last_is_taken():
    # the first module gathers its one weight into itself; its prefetch takes weights 1-3 in one flat buffer,
    # each weight's partition padded (2001 elements: 1001 a rank), from both ranks, in bf16
    buffer = 2 * 2 * (1001 + 1500 + 2000)
    assert forward_fetches(_shape(), NUMELS, MODULES) == [Fetch(buffer, 0), Fetch(buffer, 0), Fetch(buffer, 0),
                                                          Fetch(buffer, 0), Fetch(0, 0)]


def test_a_bucket_of_one_weight_prefetches_one_at_a_time_into_the_weights_themselves():
    assert forward_fetches(_shape(bucket=1), NUMELS, MODULES) == [Fetch(0, 0)] * 5


def test_a_module_fetching_two_weights_itself_holds_its_buffer_only_while_they_are_copied_out():
    fetches = forward_fetches(_shape(bucket=0), NUMELS, [[0, 1], [2, 3]])
    assert fetches == [Fetch(0, 2 * 2 * (500 + 1001)), Fetch(0, 2 * 2 * (1500 + 2000))]


def test_a_bucket_of_two_weights_makes_buffers_that_overlap_as_the_modules_take_them():
    numels = [100_000] * 6
    one = 2 * 2 * 2 * 50_000  # two weights a buffer
    fetches = forward_fetches(_shape(bucket=150_000), numels, [[i] for i in range(6)])
    # every module prefetches: module 0 takes 1 and 2 in one buffer, module 1 takes 1 from it and prefetches 3 and
    # 4 in a second; module 2 takes 2 (the first buffer goes) and prefetches 5 alone, into the weight itself
    assert [f.held for f in fetches] == [one, 2 * one, one, one, 0, 0]


def test_one_rank_or_below_zero_3_gathers_nothing():
    assert forward_fetches(_shape(world=1), NUMELS, MODULES) == [Fetch(0, 0)] * 5
    assert forward_fetches(dataclasses.replace(_shape(), stage=2), NUMELS, MODULES) == [Fetch(0, 0)] * 5


def test_weights_kept_from_forward_fetch_nothing_in_backward():
    assert [f.held + f.spike for f in replay(_shape(), NUMELS, MODULES).backward] == [0] * 5


def test_a_reuse_distance_of_0_releases_only_what_no_prefetch_walked_past():
    numels = [100_000] * 4
    one = 2 * 2 * 2 * 50_000  # two weights a buffer (bf16, 2 ranks)
    steps = replay(_shape(bucket=150_000, reuse=0), numels, [[0], [1], [2], [3]])
    # module 0 gathers weight 0 (released after it: no reuse distance) and prefetches 1 and 2 in one buffer;
    # module 1's prefetch walks the trace on: 3, then backward's entries (3 again, 2 in flight, 1 in use) to 0,
    # released by then, and takes 3 and 0 in a second buffer. The walk went past 1's and 2's backward uses, so
    # the coordinator keeps them gathered to backward; 3 is released after its forward and gathered again, alone
    assert [f.held for f in steps.forward] == [one, 2 * one, one, one]
    assert [f.gathered for f in steps.forward] == [200_000, 400_000, 400_000, 800_000]
    assert steps.forward_end == Fetch(held=one, spike=0, gathered=600_000)
    assert [(f.held, f.gathered) for f in steps.backward] == [(one, 800_000), (one, 600_000), (one, 400_000),
                                                              (0, 200_000)]


def test_the_prefetch_stops_at_stage3_max_live_parameters():
    numels = [100_000] * 4
    one = 2 * 2 * 2 * 50_000  # two weights a buffer (bf16, 2 ranks)
    unlimited = replay(_shape(bucket=1e6), numels, [[0], [1], [2], [3]])
    assert [f.held for f in unlimited.forward] == [3 * one // 2] * 3 + [0]  # 1, 2 and 3 in one buffer
    config = ds_config(stage=3, dtype="bf16")
    config["zero_optimization"].update(stage3_prefetch_bucket_size=1e6, stage3_max_live_parameters=250_000)
    limited = replay(RunShape.from_ds_config(config, 2), numels, [[0], [1], [2], [3]])
    # module 0 holds 100,000 elements: its prefetch takes 150,000 more at most (1 and 2); then 300,000 are live
    # and none is released (the default reuse distance keeps them), so module 3 gathers its own weight
    assert [f.held for f in limited.forward] == [one, one, 0, 0]


def test_the_first_steps_second_micro_batch_fetches_the_persistent_weights_and_holds_their_buffer():
    # the first micro-batch released persistent weight 4 (50 elements): the first module's prefetch takes it with
    # weights 1-3, and the buffer lives until module 3 takes it, although module 4's weight was taken last before
    numels, modules = NUMELS, [[0], [1], [2], [3], [4]]
    steady = forward_fetches(_shape(), numels, modules)
    buffer = 2 * 2 * (1001 + 1500 + 2000)
    assert [f.held for f in steady] == [buffer, buffer, buffer, 0, 0]
    first = replay(_shape(), numels, modules, persistent_kept=[]).forward
    assert [f.held for f in first] == [buffer + 2 * 2 * 25] * 4 + [0]
    # kept from the first micro-batch (a module whose inputs need no gradient): fetched by nobody
    kept = replay(_shape(), numels, modules, persistent_kept=[4]).forward
    assert [f.held for f in kept] == [buffer, buffer, buffer, 0, 0]
    # a persistent weight gathered is in the model's states, never in ``gathered``
    assert [f.gathered for f in replay(_shape(), numels, modules, persistent_kept=[]).forward] == \
        [f.gathered for f in replay(_shape(), numels, modules).forward]


def test_the_trace_names_the_weights_whose_module_takes_no_input_that_needs_a_gradient():
    # DeepSpeed's post-backward function rides on a module's inputs: the embeddings', fed token and position ids,
    # never runs, so the first micro-batch leaves their weights gathered
    from xirang_ds.memory.trace import trace_model
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec("gpt-small")
    model = build_model(spec)
    config = ds_config(stage=3, dtype="bf16", gas=2)
    trace = trace_model(lambda: build_model(spec), RunShape.from_ds_config(config, 2), spec.seq, spec.vocab)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names[i] for i in trace.unreleased_in_backward) == ["embed.weight", "pos.weight"]


def test_offload_param_on_a_gpu_copies_each_fetchs_partitions_in_beside_its_buffer():
    # the first module's own weight (one: no buffer) and its prefetch of weights 1-3 are copied in from the host,
    # each rank's partition (bf16), before the gather; the larger of the two is the call's transient
    shape = dataclasses.replace(_shape(), param_offload="cpu", device="cuda")
    assert shape.host_params
    spikes = [f.spike for f in replay(shape, NUMELS, MODULES).forward]
    assert spikes == [2 * (1001 + 1500 + 2000), 0, 0, 0, 0]
    # a module's own coalesced fetch: its buffer and its partitions copied in
    own = replay(dataclasses.replace(_shape(bucket=0), param_offload="cpu", device="cuda"), NUMELS, [[0, 1], [2, 3]])
    assert [f.spike for f in own.forward] == [2 * 2 * (500 + 1001) + 2 * (500 + 1001), 2 * 2 * 3500 + 2 * 3500]
    # on the CPU the copy is the partition itself: nothing is made
    assert [f.spike for f in replay(dataclasses.replace(shape, device="cpu"), NUMELS, MODULES).forward] == [0] * 5


def test_offload_param_on_one_rank_copies_each_weight_in_whole_as_its_module_takes_it():
    # nothing is gathered and no buffer is made; a prefetched weight reaches the device only when its module waits
    # for it, and on a CPU the copy is the host partition itself
    shape = dataclasses.replace(_shape(world=1), param_offload="cpu", device="cuda")
    steps = replay(shape, NUMELS, MODULES).forward
    assert [(f.held, f.spike) for f in steps] == [(0, 0)] * 5
    assert [f.gathered for f in steps] == [2 * 1000, 2 * (1000 + 2001), 2 * (1000 + 2001), 2 * (1000 + 2001 + 3000),
                                           2 * (1000 + 2001 + 3000 + 4000)]  # kept to backward (the reuse distance)
    assert [f.fetched for f in steps] == [2 * (1000 + 2001 + 3000 + 4000), 0, 0, 0, 0]
    assert [f.gathered for f in replay(dataclasses.replace(shape, device="cpu"), NUMELS, MODULES).forward] == [0] * 5
