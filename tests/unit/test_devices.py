"""--device / --dtype: resolved once, refused with a message that names the problem."""

import pytest
import torch

from specdec.errors import ModelLoadError
from specdec.models import resolve_device, resolve_dtype


def test_auto_picks_a_gpu_only_when_one_is_visible():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16


@pytest.mark.parametrize("device, message", [
    ("gpu0", "unknown device 'gpu0'"),
    ("meta", "unsupported device 'meta'"),
    ("cuda:99", "cuda:99"),
])
def test_bad_devices_are_refused(device, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_device(device)


def test_bad_dtype_is_refused():
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cpu")


def test_cuda_is_taken_when_visible_and_refused_with_a_reason_when_not():
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ModelLoadError, match="no CUDA GPU is visible"):
            resolve_device("cuda")
