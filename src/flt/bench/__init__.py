"""Benchmarks: approximation accuracy and speed."""
