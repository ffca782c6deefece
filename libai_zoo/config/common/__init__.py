"""Default config files every recipe builds on: ``train.py`` (the run), ``optim.py`` (the optimizer).

Load them with ``get_config("common/train.py")``: each call runs the file afresh, so a recipe that
edits its copy changes nothing else. (This directory is a package only so that the files ship in
the wheel; importing them as Python modules would share one mutable config per process.)
"""
