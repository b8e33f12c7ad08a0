"""The KV formats the example engine stores its pool in, by name (the names
of examples/engine/kv_formats.hpp), and the calibration of a format that
holds per-(layer, kv-head) scales (calibrate.hpp's rule)."""
import numpy as np
import torch

import kvcache as kv
from model import MODEL_DIR, Forward


def _side(scales, group=0, minimum=False):
    return kv.SideFormat(scales, group, minimum)


# The KV formats by name, as examples/engine/kv_formats.hpp names them:
# (pool dtype, format, calibrated, block size). A calibrated format holds
# per-(layer, kv-head) scales: EngineConfig.kv_scales, or calibrate_kv_scales'
# on the held-out text's last context window. A block size other than 0 is
# the format's own (KIVI's keys group per channel over a block of 32).
KV_FORMATS = {
    "f32": (kv.DType.f32, kv.KvFormat(), False, 0),
    "f16": (kv.DType.f16, kv.KvFormat(), False, 0),
    "fp8_e4m3_tensor": (kv.DType.fp8_e4m3, kv.KvFormat(_side(kv.Scales.tensor), _side(kv.Scales.tensor)), False, 0),
    "fp8_e4m3_head": (kv.DType.fp8_e4m3, kv.KvFormat(_side(kv.Scales.head), _side(kv.Scales.head)), True, 0),
    "int8_g32": (kv.DType.int8, kv.KvFormat(_side(kv.Scales.group, 32), _side(kv.Scales.group, 32)), False, 0),
    "int4_g32_min": (kv.DType.int4, kv.KvFormat(_side(kv.Scales.group, 32, True), _side(kv.Scales.group, 32, True)), False, 0),
    "fp4_g16": (kv.DType.fp4_e2m1, kv.KvFormat(_side(kv.Scales.group, 16), _side(kv.Scales.group, 16)), False, 0),
    "int2_g32_min": (kv.DType.int2, kv.KvFormat(_side(kv.Scales.group, 32, True), _side(kv.Scales.group, 32, True)), False, 0),
    "int2_g16_min": (kv.DType.int2, kv.KvFormat(_side(kv.Scales.group, 16, True), _side(kv.Scales.group, 16, True)), False, 0),
    "int2_kivi": (kv.DType.int2, kv.KvFormat(_side(kv.Scales.channel, 0, True), _side(kv.Scales.group, 32, True)), False, 32),
}


def heldout_window(context):
    """The held-out text's last `context` bytes: the calibration window (kv_formats.hpp's calibration_window)."""
    return list((MODEL_DIR / "heldout.bin").read_bytes())[-context:]


def calibration_window(model):
    """The tokens a calibrated format's scales are measured on: the model's
    `calibration_tokens` when it has them (a pretrained model: its own
    tokenizer's), else the tiny model's held-out window."""
    given = getattr(model, "calibration_tokens", None)
    return list(given) if given is not None else heldout_window(model.c["context"])


class _AmaxKv:
    """A plain store for one forward call over a calibration window; keeps
    each (layer, kv-head)'s largest |K| and |V|."""

    def __init__(self, layers, heads):
        self.k, self.v = [None] * layers, [None] * layers
        self.amax = np.zeros((2, layers, heads), dtype=np.float32)

    def write(self, layer, k, v):  # [n, kv_heads, head_dim]
        self.k[layer], self.v[layer] = k, v
        self.amax[0, layer] = k.abs().amax(dim=(0, 2)).numpy()
        self.amax[1, layer] = v.abs().amax(dim=(0, 2)).numpy()

    def read(self, layer):
        n, heads = self.k[layer].shape[:2]
        return self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1), torch.arange(n).expand(heads, n)


def calibrate_kv_scales(model, window, dtype):
    """Per-(layer, kv-head) scales, [layers * kv_heads] for K and for V: the
    window's largest |K| (after RoPE) and |V| over the code's largest
    (calibrate.hpp's rule; a head of zeros gets 1)."""
    c = model.c
    store = _AmaxKv(c["layers"], c["kv_heads"])
    Forward(model).run(store, list(window), 0, True)
    amax = store.amax.reshape(2, -1)
    scales = np.where(amax > 0, amax / np.float32(kv.code_max(dtype)), np.float32(1)).astype(np.float32)
    return scales[0].tolist(), scales[1].tolist()
