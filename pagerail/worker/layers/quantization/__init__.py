"""Quantized weight formats: checkpoint configs, linear methods and their kernels."""
