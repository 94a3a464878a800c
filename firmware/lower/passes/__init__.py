"""The lowering's passes, one module each; firmware/lower/pipeline.py runs them in order."""
