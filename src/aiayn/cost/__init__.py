"""What a training run costs before it runs (``aiayn estimate``): time, device-hours and FLOPs of a
recipe on N devices (``estimate``), from the accelerators' peak rates and Table 2's figures
(``devices``)."""
