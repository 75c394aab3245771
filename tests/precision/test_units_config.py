"""The precision section at config time: op names, lists, globs, ds_config conflicts, devices, Apex."""
import sys
import types

import pytest
import torch

from xirang_ds import XirangConfigError, load_config
from xirang_ds.plugins.precision.apex_lists import apex_registrations
from xirang_ds.plugins.precision.config import PrecisionConfig
from xirang_ds.plugins.precision.ds_config import check_device_dtype, plan
from xirang_ds.plugins.precision.kernels import native_autocast_ops
from xirang_ds.plugins.precision.op_lists import (
    FP32_DEFAULT,
    LOW_PRECISION_DEFAULT,
    OpNameError,
    build_op_lists,
    resolve,
)


def problems(section: dict) -> dict[str, str]:
    with pytest.raises(XirangConfigError) as info:
        load_config({"xirang": {"precision": {"enabled": True, **section}}})
    return dict(info.value.problems)


def lists(low=("default",), fp32=("default",)):
    found: list = []
    out = build_op_lists(low, fp32, "p", found)
    assert found == []
    return out


def test_every_default_name_is_an_operator_of_this_torch():
    for name in LOW_PRECISION_DEFAULT + FP32_DEFAULT:
        assert resolve(name), name
    assert not set(LOW_PRECISION_DEFAULT) & set(FP32_DEFAULT)


def test_defaults_cover_torch_cpu_autocast_lists():
    """Every op PyTorch's CPU autocast handles is on our lists, except its 'promote' ops (cat, stack,
    index_copy), which follow their inputs here too; its low-precision ops are all white."""
    ours = lists()
    native = native_autocast_ops("AutocastCPU")
    assert native - ours.low - ours.fp32 == {"aten::cat", "aten::stack", "aten::index_copy", "aten::index_copy.dimname"} & native
    for op in ("aten::mm", "aten::linear", "aten::conv2d", "aten::scaled_dot_product_attention", "aten::bmm"):
        assert op in ours.low
    for op in ("aten::softmax.int", "aten::log_softmax.int", "aten::layer_norm", "aten::cross_entropy_loss",
               "aten::exp", "aten::sum", "aten::sum.dim_IntList", "aten::native_layer_norm"):
        assert op in ours.fp32


def test_names_aliases_overloads_and_namespaces():
    assert resolve("aten::bmm") == resolve("bmm") and "aten::bmm" in resolve("bmm")
    assert resolve("cross_entropy") == ("aten::cross_entropy_loss",)
    assert resolve("pow.Scalar") == ("aten::pow.Scalar",)
    assert "aten::softmax.int" in resolve("softmax") and "aten::softmax.int_out" not in resolve("softmax")
    with pytest.raises(OpNameError, match="has no overload 'Bogus'"):
        resolve("pow.Bogus")
    with pytest.raises(OpNameError, match="in-place or out="):
        resolve("exp_")


def test_tokens_add_remove_in_order():
    out = lists(low=("default", "gelu", "-bmm"), fp32=("default", "-pow.Scalar"))
    assert "aten::gelu" in out.low and "aten::bmm" not in out.low
    assert "aten::pow.Scalar" not in out.fp32 and "aten::pow.Tensor_Scalar" in out.fp32
    empty = lists(low=(), fp32=("softmax",))
    assert empty.low == frozenset() and empty.fp32 == frozenset(resolve("softmax"))
    assert out.policy_of("aten::gelu") == "low" and out.policy_of("aten::add.Tensor") == "follow"


@pytest.mark.parametrize("section, path, fragment", [
    ({"low_precision_ops": ["default", "gleu"]}, "xirang.precision.low_precision_ops[1]",
     "'gleu' is not a torch operator (names are ATen ops as in torch.ops.aten.<name>, or 'namespace::op'); "
     "did you mean 'glu' or 'gelu'?"),
    ({"low_precision_ops": ["default", "softmax"]}, "xirang.precision.fp32_ops",
     "softmax is in both low_precision_ops and fp32_ops; remove it from one, e.g. add \"-softmax\" to fp32_ops"),
    ({"fp32_ops": ["-softmax", "default"]}, "xirang.precision.fp32_ops[0]",
     "'-softmax' removes nothing: 'softmax' is not in the list built so far"),
    ({"fp32_ops": ["default", "default"]}, "xirang.precision.fp32_ops[1]", "'default' is listed twice; remove one"),
    ({"fp32_ops": ["default", "exp_"]}, "xirang.precision.fp32_ops[1]",
     "'exp_' has only in-place or out= overloads, which cannot be cast; list the out-of-place op instead (for "
     "example 'exp')"),
    ({"fp32_modules": ["lm_head", "lm_head"]}, "xirang.precision.fp32_modules[1]", "'lm_head' is listed twice"),
    ({"fp32_modules": [" "]}, "xirang.precision.fp32_modules[0]", "is empty"),
    ({"dtype": "fp8"}, "xirang.precision.dtype", "must be one of 'auto', 'bf16', 'fp16'; got 'fp8'"),
])
def test_bad_lists_are_errors_naming_path_value_and_fix(section, path, fragment):
    found = problems(section)
    assert fragment in found[path], found


def test_all_list_problems_at_once():
    found = problems({"low_precision_ops": ["default", "nope", "gelu"], "fp32_ops": ["default", "gelu", "zzz"]})
    assert set(found) == {"xirang.precision.low_precision_ops[1]", "xirang.precision.fp32_ops[2]",
                          "xirang.precision.fp32_ops"}


def test_valid_section_loads():
    cfg = load_config({"xirang": {"precision": {"enabled": True, "low_precision_ops": ["default", "gelu"],
                                                "fp32_ops": ["default", "-sum"], "fp32_modules": ["lm_head"]}}})
    assert cfg.precision.low_precision_ops == ("default", "gelu")


# ds_config --------------------------------------------------------------------------------------

def ds(**sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, **sections}


@pytest.mark.parametrize("config, ds_config, path, fragment", [
    (PrecisionConfig(), ds(bf16={"enabled": True}, fp16={"enabled": True}), "fp16.enabled", "both bf16 and fp16"),
    (PrecisionConfig(dtype="fp16"), ds(bf16={"enabled": True}), "xirang.precision.dtype",
     "is 'fp16' but ds_config enables bf16; write dtype \"auto\""),
    (PrecisionConfig(), ds(torch_autocast={"enabled": True}), "torch_autocast.enabled", "remove the torch_autocast"),
    (PrecisionConfig(), ds(zero_optimization={"stage": 3}), "zero_optimization.stage", "supports ZeRO stages 0, 1 and 2"),
    (PrecisionConfig(), ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
     "bf16.bf16_master_weights_and_grads", "keep fp32 masters; remove the key or set xirang.precision.weight_copies"),
    (PrecisionConfig(), ds(fp16={"enabled": True, "auto_cast": True}), "fp16.auto_cast", "remove the key"),
    (PrecisionConfig(), ds(fp16={"enabled": True, "loss_scale_window": 0}), "fp16",
     "DeepSpeed rejects this section: "),
])
def test_ds_config_conflicts(config, ds_config, path, fragment):
    decided, found = plan(config, ds_config)
    assert decided is None
    assert fragment in dict(found)[path], found


def test_plan_follows_ds_config_and_reads_loss_scale_settings():
    decided, found = plan(PrecisionConfig(), ds(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}))
    assert found == [] and decided.dtype == torch.float16 and decided.check_overflow
    assert decided.loss_scale.dynamic_args["init_scale"] == 256 and decided.loss_scale.dynamic_args["delayed_shift"] == 1
    decided, _ = plan(PrecisionConfig(), ds(fp16={"enabled": True, "loss_scale": 128}))
    assert decided.loss_scale.static_scale == 128.0
    decided, _ = plan(PrecisionConfig(), ds())
    assert decided.dtype == torch.bfloat16 and decided.loss_scale is None and decided.check_overflow
    decided, _ = plan(PrecisionConfig(), ds(bf16={"enabled": True, "check_grad_overflow": False}))
    assert not decided.check_overflow


def test_fp16_refused_with_a_plugin_that_applies_unscaled_gradients():
    from xirang_ds.plugins.precision.plugin import loss_scale_conflicts

    fp16, _ = plan(PrecisionConfig(), ds(fp16={"enabled": True}))
    bf16, _ = plan(PrecisionConfig(), ds())
    unaware = types.SimpleNamespace(section="grad_release")
    aware = types.SimpleNamespace(section="grad_release", applies_loss_scale=True)
    [(path, message)] = loss_scale_conflicts(fp16, unaware)
    assert path == "xirang.precision.dtype"
    assert "xirang.grad_release applies the gradients inside backward" in message
    assert "set xirang.precision.weight_copies to \"persistent\"" in message
    assert loss_scale_conflicts(fp16, aware) == [] == loss_scale_conflicts(bf16, unaware) == loss_scale_conflicts(fp16, None)


def test_weight_copies_auto_picks_the_layout_with_fewer_weight_bytes():
    from xirang_ds.plugins.precision.ds_config import choose_weight_copies

    assert choose_weight_copies("auto", 0, 8) == "on_demand"  # 4 bytes/param against DeepSpeed's 6
    assert choose_weight_copies("auto", 2, 1) == "on_demand"  # 4 against 2 + 4/1
    assert choose_weight_copies("auto", 1, 2) == choose_weight_copies("auto", 2, 4) == "persistent"  # 2 + 4/N <= 4
    assert choose_weight_copies("on_demand", 2, 8) == "on_demand"


def test_ds_config_edits_per_layout():
    from xirang_ds.plugins.precision.ds_config import edit_ds_config

    user = ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization={"stage": 2})
    decided, found = plan(PrecisionConfig(), user, world_size=2)
    assert found == [] and decided.weight_copies == "persistent" and decided.loss_scale is None
    assert not decided.check_overflow  # DeepSpeed's bf16 mode checks
    copy = dict(user)
    edit_ds_config(copy, decided)
    assert copy["bf16"] == user["bf16"]
    decided, _ = plan(PrecisionConfig(dtype="fp16", weight_copies="persistent"), ds(), world_size=1)
    copy = ds()
    edit_ds_config(copy, decided)
    assert copy["fp16"] == {"enabled": True} and decided.loss_scale is None
    decided, _ = plan(PrecisionConfig(), ds(bf16={"enabled": True}), world_size=1)
    copy = ds(bf16={"enabled": True})
    edit_ds_config(copy, decided)
    assert decided.on_demand and "bf16" not in copy  # DeepSpeed trains in fp32


class _Accelerator:
    """Capability answers of a DeepSpeed accelerator (only these two methods are read)."""

    def __init__(self, bf16: bool, fp16: bool):
        self._bf16, self._fp16 = bf16, fp16

    def is_bf16_supported(self) -> bool:
        return self._bf16

    def is_fp16_supported(self) -> bool:
        return self._fp16


def test_device_dtype_check():
    assert check_device_dtype("cpu", torch.bfloat16, _Accelerator(True, False)) is None
    assert check_device_dtype("cpu", torch.float16, _Accelerator(True, False)) is None  # torch's reference kernels
    reason = check_device_dtype("cpu", torch.float8_e4m3fn, _Accelerator(True, True))
    assert reason.startswith("float8_e4m3fn cannot run on cpu (")
    assert check_device_dtype("cuda", torch.bfloat16, _Accelerator(False, True)) == \
        "DeepSpeed's cuda accelerator reports that this device cannot run bfloat16"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the estimator lets plugins edit the ds_config under fake tensors
        assert check_device_dtype("cpu", torch.bfloat16, _Accelerator(True, False)) is None


# NVIDIA Apex registrations ---------------------------------------------------------------------------

@pytest.fixture
def apex_standin(monkeypatch):
    """A stand-in for NVIDIA Apex's registry form (apex/amp/amp.py, apex/amp/utils.py): the same
    module paths and data structures, since Apex itself cannot be installed here."""
    apex, amp, amp_amp, utils = (types.ModuleType(n) for n in ("apex", "apex.amp", "apex.amp.amp", "apex.amp.utils"))
    apex.__path__, amp.__path__ = [], []
    utils.maybe_half = lambda x: x
    utils.maybe_float = lambda x: x
    amp_amp._USER_CAST_REGISTRY, amp_amp._USER_PROMOTE_REGISTRY = set(), set()
    amp_amp.register_half_function = lambda m, n: amp_amp._USER_CAST_REGISTRY.add((m, n, utils.maybe_half))
    amp_amp.register_float_function = lambda m, n: amp_amp._USER_CAST_REGISTRY.add((m, n, utils.maybe_float))
    amp_amp.register_promote_function = lambda m, n: amp_amp._USER_PROMOTE_REGISTRY.add((m, n))
    amp.amp, amp.utils = amp_amp, utils
    for name, module in (("apex", apex), ("apex.amp", amp), ("apex.amp.amp", amp_amp), ("apex.amp.utils", utils)):
        module.__spec__ = types.SimpleNamespace(name=name)
        monkeypatch.setitem(sys.modules, name, module)
    return amp_amp


def test_apex_registrations_move_ops_between_lists(apex_standin):
    apex_standin.register_half_function(torch, "sigmoid")
    apex_standin.register_float_function(torch, "matmul")
    apex_standin.register_promote_function(torch, "addcmul")
    found: list = []
    registered = apex_registrations("xirang.precision", found)
    assert found == [] and registered.half == ("sigmoid",) and registered.float == ("matmul",)
    out = build_op_lists(("default",), ("default",), "xirang.precision", found, registered)
    assert found == []
    assert "aten::sigmoid" in out.low and "aten::matmul" in out.fp32 and "aten::matmul" not in out.low
    assert out.policy_of("aten::addcmul") == "promote"


def test_apex_registration_conflicting_with_an_explicit_entry_or_not_an_op(apex_standin):
    apex_standin.register_float_function(torch, "matmul")
    apex_standin.register_half_function(torch.nn.functional, "softmin")
    found: list = []
    registered = apex_registrations("xirang.precision", found)
    assert "apex.amp.register_half_function(torch.nn.functional, 'softmin'): 'softmin' is not a torch operator" in found[0][1]
    build_op_lists(("default", "-matmul", "matmul"), ("default",), "xirang.precision", found, registered)
    assert "matmul is in both low_precision_ops and fp32_ops" in found[-1][1]


def test_without_nvidia_apex_nothing_is_registered(monkeypatch):
    unrelated = types.ModuleType("apex")  # PyPI's "apex" is a different project without amp
    unrelated.__spec__ = types.SimpleNamespace(name="apex")
    monkeypatch.setitem(sys.modules, "apex", unrelated)
    found: list = []
    assert apex_registrations("xirang.precision", found) == type(apex_registrations("x", []))()
    assert found == []
