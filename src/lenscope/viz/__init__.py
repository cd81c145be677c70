"""Plots (matplotlib, headless) and self-contained HTML pages."""
