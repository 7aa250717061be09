import torch

# The tiny model's ops are too small to gain from intra-op threads, and on a shared 2-core machine spinning
# OpenMP workers make them many times slower.
torch.set_num_threads(1)
