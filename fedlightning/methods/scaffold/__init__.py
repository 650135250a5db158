"""SCAFFOLD (Karimireddy et al., ICML 2020): client and server control variates correct the
client drift of local steps; the worked example of docs/architecture.md, "Adding a method"."""
