"""Routes: v1_bash (being written)."""

from fastapi import APIRouter

router = APIRouter()
