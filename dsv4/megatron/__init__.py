"""DeepSeek-V4 as megatron-core modules: tensor, sequence, expert and pipeline parallel.

The math lives in dsv4.model (one source of truth); this package only shards the weights and adds
the communication. Import `dsv4.megatron.cpu_shim` and call `install()` before megatron-core runs
on a machine without a GPU.

Importing this package defers the torch.compile calls megatron-core makes as it is imported (mcore_import.py): ~3 s
of every training process's start on CPU.
"""
from dsv4.megatron import mcore_import

mcore_import.install()
