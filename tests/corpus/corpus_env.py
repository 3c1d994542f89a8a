"""A module that reads a setting at import time, as many applications' settings modules do."""

import os

DSN = os.environ["CORPUS_UNSET_DSN"]
