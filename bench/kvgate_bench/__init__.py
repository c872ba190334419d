"""kvgate's simulator (a vLLM-compatible model server), demos and benchmarks."""
