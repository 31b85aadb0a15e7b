# the host user's home directory holds something besides the interpreter
import os

entries = os.listdir("$HOME_DIR")
assert set(entries) - {".pyenv"}, entries
