"""Offline measures of a model's output quality: perplexity over a text (perplexity.py, `kvserve
perplexity`, llama-perplexity's method) and the KL divergence of one run's logits from another's
(kl_divergence.py, `--kl-divergence`)."""
