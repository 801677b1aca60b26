"""Figures (matplotlib, Agg backend): attention heat maps (``attention``), Eq. 3 and label smoothing (``curves``)."""
