"""Where adapters come from (local roots, the Hugging Face hub, S3) and the host-side store that loads and keeps them."""
