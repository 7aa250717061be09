import pytest
import torch

# The tiny model's ops are too small to gain from intra-op threads, and on a shared 2-core machine spinning
# OpenMP workers make them many times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The tiny model's random checkpoint in the released layout (FP8 + MXFP4, official names), one per module."""
    from dsv4 import checkpoint as ck
    from dsv4.config import ModelConfig
    d = tmp_path_factory.mktemp("gen") / "tiny"
    ck.generate_checkpoint(ModelConfig.preset("tiny"), d, shard_bytes=600_000)
    return d
