"""The shipped configs. The wheel installs this directory as the package
``lmscale_jax.configs`` (setup.py's ``package_dir``), so an installed ``lmscale train --config
tiny`` finds them by name (``config/loader.resolve``); in a checkout they stay plain files,
``--config configs/tiny.py``. Copy one to start your own: any file with a ``get_config()``
works."""
