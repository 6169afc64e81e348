"""Interactive Textual viewer over the analyzed run model."""
