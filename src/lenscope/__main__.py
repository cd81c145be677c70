"""``python -m lenscope ...`` (the same as the ``lenscope`` command; ``torchrun ... -m lenscope lens train``)."""

from .cli import main

main()
