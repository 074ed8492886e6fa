"""Tests of the Helm chart (helm/tandem), rendered with Helm's own library."""
