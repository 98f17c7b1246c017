"""The gym: attention variants in use, the benchmark and the demo."""
