"""What the pretrained models' tests share (test_pretrained.py,
test_one_engine.py): the models' fixtures live in conftest.py; here the
held-out text in a model's tokens and the check against the dense reference."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import model as mdl  # noqa: E402

# float32 throughout; torch sums a chunk's products in another order than the
# one-pass reference (BLAS blocking): seen up to 1.3e-4 on logits up to ~50.
LOGIT_TOLERANCE = 1e-3


def text_tokens(tok, start, count):
    """`count` tokens of the KJV held-out text (the tiny model's, shipped) from byte `start`."""
    text = (mdl.MODEL_DIR / "heldout.bin").read_bytes().decode("latin-1")
    return tok.encode(text[start:start + 8 * count], bos=False)[:count]


def check_dense(m, r, round_trip=None):
    """r's logits, at every position the engine computed them, against the reference's."""
    seq = r.prompt + r.output
    ref = mdl.reference_logits(m, seq[:-1], round_trip)
    assert r.chunk_logits, "keep_logits: no logits kept"
    for first, logits in r.chunk_logits:
        want = ref[first:first + logits.shape[0]]
        diff = (logits - want).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"request {r.id}: positions {first}..: logits differ by {diff}"
    got = torch.tensor(r.output)
    greedy = ref[len(r.prompt) - 1:].argmax(-1)
    assert torch.equal(greedy, got), f"request {r.id}: greedy tokens differ at {(greedy != got).nonzero()[0].item()}"
