import os
import sys

# tests/ holds user-style model factories addressed as "models_for_tests:factory".
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Models compile eagerly unless a test names its compiler: autosp's default, Inductor, takes tens
# of seconds per graph on 2 CPU cores (the compiled path has its own tests, and one takes the default).
os.environ.setdefault("AUTOSP_COMPILER", "eager")
