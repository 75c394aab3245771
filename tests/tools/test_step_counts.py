"""`xirang_ds.step_counts`: ops that compute are counted, views and size queries are not; the device
counts are left ``None`` where no CUDA device can report them."""
import torch

from xirang_ds.step_counts import count_ops, count_step


def test_views_and_size_queries_count_nothing_and_each_computing_op_once():
    x = torch.randn(4, 6)

    def views():
        return x.view(6, 4).t().transpose(0, 1)[1:].unsqueeze(0).size(1)

    def three():
        y = x + 1              # one
        y.mul_(2)              # in place: computes, one
        return y.t().sum()     # a view (none), then one

    assert count_ops(views)[1] == 0
    out, ops = count_ops(three)
    assert ops == 3 and torch.equal(out, ((x + 1) * 2).sum())


def test_a_training_step_on_the_cpu_counts_ops_only_and_runs_the_step():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step():
        opt.zero_grad(set_to_none=True)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()

    counts = count_step(step, "cpu").as_dict()
    assert counts["ops"] > 0 and counts["kernels"] is None and counts["host_syncs"] is None
    assert not torch.equal(model.weight, before)  # the counted step is a real step
    assert count_step(step, "cpu").ops == counts["ops"]  # the same program, the same count
