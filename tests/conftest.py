import os
import sys

import pytest

# tests import their helpers (launcher_util) by plain name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# helpers that assert for the tests calling them: their failures get pytest's detailed messages
pytest.register_assert_rewrite("megatron_trainer")
