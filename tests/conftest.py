import os
import sys

# tests import their helpers (launcher_util) by plain name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
