import os
import sys

# tests/ holds user-style model factories addressed as "models_for_tests:factory".
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
