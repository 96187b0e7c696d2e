"""Paged-attention kernels: `torch_paged` is the plain-torch reference every other kernel
in this package (one per file) is checked against."""
