"""kvserve's tests, one package, so its folders never shadow a PyPI package of the same name
(tests/kernels is not `kernels`, which transformers imports when it is installed)."""
