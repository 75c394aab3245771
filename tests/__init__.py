"""Test package setup, run in the test process and in every rank process `run_ranks` starts (they
import the test modules through this package)."""


def _fp16_on_every_cpu() -> None:
    """DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels (Intel CPUs with
    AVX512-FP16 or AMX-FP16: ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``), and its engine
    refuses an fp16 ds_config everywhere else ("Type fp16 is not supported on your device"). torch
    computes fp16 on every CPU with its reference kernels, which is all these tests need: the fp16
    runs stand in for a GPU's on any CPU, the same on every machine the suite runs on."""
    try:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:  # pragma: no cover - deepspeed is a test requirement
        return
    CPU_Accelerator.is_fp16_supported = lambda self: True


_fp16_on_every_cpu()
