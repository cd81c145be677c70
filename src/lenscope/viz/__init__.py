"""Plots (matplotlib, headless) and, later, the HTML report."""
