"""Load Hugging Face models and tokenizers from local paths; build tiny ones for tests and demos.

Nothing is imported here on purpose: the config layer and the CLI import `roll.models.loading` for its
cheap path check and must not pay for torch or transformers. Import the submodules directly.
"""
