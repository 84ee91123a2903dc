"""The Hydra config tree of `edit-train` (the YAML files; this file only makes it a package).

It lives at the top of the repository, to be read, copied and overridden; pyproject.toml maps it to the
package `edit_train.conf`, so a wheel ships it as edit_train/conf/ and an editable install finds it here.
Nothing imports this module: `edit_train.config_tree` locates the directory without importing it."""
