"""kvgate's simulator (a vLLM-compatible model server), demo and benchmarks."""
