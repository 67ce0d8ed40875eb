"""The ring all-reduce in any wire: the program, the wires (codecs), the block wires' kernels."""
