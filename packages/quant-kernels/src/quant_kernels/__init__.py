"""quant_kernels."""
