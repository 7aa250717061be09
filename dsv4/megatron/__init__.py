"""DeepSeek-V4 as megatron-core modules: tensor, sequence, expert and pipeline parallel.

The math lives in dsv4.model (one source of truth); this package only shards the weights and adds
the communication. Import `dsv4.megatron.cpu_shim` and call `install()` before megatron-core runs
on a machine without a GPU.
"""
